"""Where NCCL and gloo differ, one code path decides: each decision checked here, on a CPU.

The backend (nccl with a GPU for every rank of this machine, forked or under torchrun), the
device of a rank (cuda:LOCAL_RANK), the communicators made at init under nccl (a first
batch_isend_irecv in a group must otherwise involve all its ranks), and "avg" (nccl's own AVG,
gloo's sum then divide). No GPU is touched: torch.cuda.device_count and the collectives are
stood in for, and what minitron asks of them is recorded.
"""
import pytest
import torch
import torch.distributed as dist

from minitron.runtime import comm, comm_async, process_group as pg

TORCHRUN_2x2 = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this machine has n GPUs, as NVML would say; no backend is forced."""
    monkeypatch.delenv("MINITRON_BACKEND", raising=False)
    return lambda n: monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_nccl_only_with_a_gpu_for_every_rank_of_this_machine(gpus):
    gpus(8)
    assert [pg.pick_backend(n) for n in (1, 8, 9)] == ["nccl", "nccl", "gloo"]
    gpus(0)
    assert pg.pick_backend(1) == "gloo"


def test_under_torchrun_the_ranks_of_this_node_count_not_the_world(gpus, monkeypatch):
    for key, value in TORCHRUN_2x2.items():
        monkeypatch.setenv(key, value)
    gpus(2)                                   # two nodes of two GPUs: 4 ranks, 2 per node
    assert pg.ranks_on_this_machine(4) == 2
    assert pg.pick_backend(pg.ranks_on_this_machine(4)) == "nccl"
    monkeypatch.delenv("RANK")                # forked ranks: all of them on this machine
    assert pg.ranks_on_this_machine(4) == 4


def test_a_rank_owns_the_gpu_of_its_local_rank_and_nccl_makes_its_communicators_at_init():
    assert pg.rank_device("nccl", 3) == torch.device("cuda", 3)
    assert pg.rank_device("gloo", 3) == torch.device("cpu")
    assert pg.group_options("nccl", 1) == {"device_id": torch.device("cuda", 1)}
    assert pg.group_options("gloo", 1) == {}


def test_a_local_rank_without_a_gpu_is_refused_before_cuda_is_touched(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device was called"))
    with pytest.raises(RuntimeError, match="local rank 1 has no GPU of its own: this machine has 1"):
        pg.init_process_group("nccl", 1, 2, timeout=5)


def test_avg_is_nccls_own_op_and_gloos_sum_then_divide():
    assert comm.reduce_plan("avg", "nccl") == (dist.ReduceOp.AVG, False)
    assert comm.reduce_plan("avg", "gloo") == (dist.ReduceOp.SUM, True)
    for backend in ("nccl", "gloo"):
        assert comm.reduce_plan("sum", backend) == (dist.ReduceOp.SUM, False)
        assert comm.reduce_plan("max", backend) == (dist.ReduceOp.MAX, False)
    with pytest.raises(ValueError, match="use one of sum, max, min, avg"):
        comm.reduce_plan("mean", "nccl")


class _Done:
    def wait(self):
        return True


def _two_ranks_holding_the_same_tensor(monkeypatch, backend: str, seen: list):
    """dist as seen from rank 0 of two ranks whose tensors are equal: SUM doubles, AVG keeps."""
    def reduce(t, op):
        seen.append(op)
        if op == dist.ReduceOp.AVG and backend == "gloo":
            raise RuntimeError("gloo has no AVG")
        return t.mul_(2) if op == dist.ReduceOp.SUM else t

    def all_reduce(t, op, group=None, async_op=False):
        reduce(t, op)
        return _Done() if async_op else None

    def reduce_scatter(out, x, op, group=None, async_op=False):
        out.copy_(reduce(x.clone(), op)[:out.numel()])
        return _Done() if async_op else None

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(comm, "_reduce_scatter_flat", reduce_scatter)
    monkeypatch.setattr(comm_async, "_reduce_scatter_flat", reduce_scatter)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_every_avg_collective_takes_the_decision_of_its_groups_backend(monkeypatch, backend):
    seen = []
    _two_ranks_holding_the_same_tensor(monkeypatch, backend, seen)
    group = comm.Group("dp", [0, 1], pg=object())
    x = torch.full((4,), 3.0)
    results = [comm.all_reduce(x.clone(), group, "avg"), comm.reduce_scatter(x.clone(), group, op="avg"),
               comm_async.all_reduce(x.clone(), group, "avg").wait(),
               comm_async.reduce_scatter(x.clone(), group, "avg").wait()]
    assert [r.tolist() for r in results] == [[3.0] * 4, [3.0] * 2, [3.0] * 4, [3.0] * 2]
    want = dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
    assert seen == [want] * 4
