"""How many threads a 4-rank pool holds after building the grids of 10 configs (each gloo process
group keeps threads and sockets of its own; grids share the groups of equal ranks, grid/groups.py).
    python tests/stress/group_threads.py
"""
import os, sys, time
from minitron.runtime.pool import WorkerPool
from minitron.grid import ParallelConfig

CONFIGS = [dict(tp=4), dict(dp=4), dict(tp=2, dp=2), dict(pp=2, dp=2), dict(tp=2, pp=2),
           dict(cp=2, dp=2), dict(ep=2, dp=2), dict(tp=2, cp=2), dict(cp=4), dict(ep=4)]

def build(cfgs):
    for c in cfgs:
        ParallelConfig(**c).build()
    return len(os.listdir("/proc/self/task"))

if __name__ == "__main__":
    pool = WorkerPool(4)
    t = time.perf_counter()
    threads = pool.run(build, CONFIGS)
    print(f"threads per rank {threads}, {time.perf_counter() - t:.2f} s")
    pool.close()
