"""How ranks start, talk and fail: what every dimension is built on.

launch.py       launch(fn, world_size=N): forked ranks (scripts, pytest, notebooks) or torchrun's
rank_process.py   one forked rank: its process, pipe and shared status (launch's and pool's)
rank_failures.py  RankError, and which rank a failure is blamed on (a peer died, a peer stalled)
process_group.py  which backend, how a rank joins its group (forked ranks: at a store their parent
                  serves, on a port its own bind chose), the run under torchrun
pool.py         WorkerPool: ranks kept alive across launches (many small jobs: the tests)
deadline.py     the watchdog that tells a hang from a long computation
rank_output.py  what ranks print, echoed in rank order; their stderr kept for a failure
comm.py         every collective and send/recv, counted in calls and bytes (the only door to
                torch.distributed); collectives here, re-exporting the two below
comm_core.py      Group, CommError, and the one wrapper every call goes through (count, name)
comm_p2p.py       send, recv and exchange (point to point)
comm_async.py   the same collectives started now and waited for later (overlap)
counting.py     the counters behind comm.counting()
"""
