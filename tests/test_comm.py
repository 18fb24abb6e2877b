"""Every counted wrapper in minitron.runtime.comm: exact results on rank-valued tensors, exact bytes.

Rank r holds tensors filled from r, so every expected result is written down by hand:
the sum over n ranks of r is n(n-1)/2, the max is n-1, and so on.
"""
import pytest
import torch
import torch.distributed as dist

from minitron.runtime import comm
from minitron.runtime.comm import P2P, Group

F32 = 4  # bytes per float32


def _world() -> Group:
    return Group("world", range(dist.get_world_size()), dist.group.WORLD)


# ---- workers (module level: the pool pickles them by name) ----
def _reductions():
    g, r = _world(), dist.get_rank()
    out = {}
    for op in ("sum", "max", "min", "avg"):
        t = torch.full((3, 2), float(r)) + torch.arange(6.0).view(3, 2)
        with comm.counting() as c:
            res = comm.all_reduce(t, g, op=op)
        out[op] = (res, res is t, c.calls(), c.bytes(), c.wire_bytes())
    return out


def _gathers():
    g, r = _world(), dist.get_rank()
    t = torch.full((2, 3), float(r))
    with comm.counting() as c:
        d0 = comm.all_gather(t, g, dim=0)
        d1 = comm.all_gather(t, g, dim=1)
    return d0, d1, c.as_dict()


def _reduce_scatters():
    g, r, n = _world(), dist.get_rank(), dist.get_world_size()
    # element value: 10 * position + r, so the sum over ranks is n*10*position + n(n-1)/2
    t0 = 10 * torch.arange(2.0 * n).view(2 * n, 1).expand(2 * n, 3) + r
    t1 = 10 * torch.arange(2.0 * n).view(1, 2 * n).expand(3, 2 * n) + r
    with comm.counting() as c:
        d0 = comm.reduce_scatter(t0, g, dim=0)
        d1 = comm.reduce_scatter(t1, g, dim=1)
    return d0, d1, c.as_dict()


def _all_to_all(uneven: bool):
    g, r, n = _world(), dist.get_rank(), dist.get_world_size()
    # rank r sends rows to rank j; each row holds 100*r + j, so the receiver can tell who sent it
    rows = (lambda src, dst: src + dst + 1) if uneven else (lambda src, dst: 2)
    in_splits = [rows(r, j) for j in range(n)]
    out_splits = [rows(i, r) for i in range(n)]
    t = torch.cat([torch.full((rows(r, j), 2), 100.0 * r + j) for j in range(n)])
    with comm.counting() as c:
        if uneven:
            out = comm.all_to_all(t, g, out_splits, in_splits)
        else:
            out = comm.all_to_all(t, g)
    return t.shape[0], out, out_splits, c.bytes(), c.wire_bytes()


def _broadcast_and_p2p():
    g, r, n = _world(), dist.get_rank(), dist.get_world_size()
    res = {}
    t = torch.full((5,), float(r))
    with comm.counting() as c:
        comm.broadcast(t, g, src=n - 1)
    res["broadcast"] = (t, c.bytes(), c.wire_bytes())

    # send/recv: rank 0 sends to rank 1
    msg = torch.full((4,), 7.0 + r)
    with comm.counting() as c:
        if r == 0:
            comm.send(msg, g, dst=1)
        elif r == 1:
            comm.recv(msg, g, src=0)
    res["p2p"] = (msg, c.as_dict())

    # a ring shift: everyone sends to the right and receives from the left at once
    mine, got = torch.full((3,), float(r)), torch.empty(3)
    with comm.counting() as c:
        comm.exchange([P2P("send", mine, (r + 1) % n), P2P("recv", got, (r - 1) % n)], g)
    res["ring"] = (got, c.as_dict())
    return res


def _nested_and_single():
    g = _world()
    t = torch.ones(8)
    with comm.counting() as outer:
        comm.all_reduce(t, g)
        with comm.counting() as inner:
            comm.all_reduce(t, g)
            comm.all_gather(t, g)
        comm.broadcast(t, g)
    one = comm.single_group()
    with comm.counting() as c1:
        x = torch.ones(4)
        same = [comm.all_reduce(x, one) is x, comm.all_gather(x, one) is x,
                comm.reduce_scatter(x, one) is x, comm.all_to_all(x, one) is x,
                comm.broadcast(x, one) is x]
        comm.barrier(one)
    return outer.as_dict(), inner.as_dict(), same, c1.as_dict()


def _identity():
    g, r = _world(), dist.get_rank()
    torch.manual_seed(r)
    x = torch.randn(8, 5)
    with comm.counting() as c_ar:
        ar = comm.all_reduce(x.clone(), g)
    with comm.counting() as c_two:
        two = comm.all_gather(comm.reduce_scatter(x, g, dim=0), g, dim=0)
    return (ar - two).abs().max().item(), ar.abs().max().item(), c_ar.wire_bytes(), c_two.wire_bytes(), \
        c_ar.bytes(), c_two.bytes(op="reduce_scatter"), c_two.bytes(op="all_gather")


# ---- tests ----
SIZES = [2, 4]


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_ops(run_ranks, n):
    base = torch.arange(6.0).view(3, 2)
    expected = {"sum": n * base + n * (n - 1) / 2, "max": base + n - 1, "min": base,
                "avg": base + (n - 1) / 2}
    S = 6 * F32
    for res in run_ranks(_reductions, world_size=n):
        for op, (t, in_place, calls, payload, wire) in res.items():
            assert torch.equal(t, expected[op]), op
            assert in_place, op
            assert (calls, payload, wire) == (1, S, 2 * (n - 1) / n * S), op


@pytest.mark.parametrize("n", SIZES)
def test_all_gather(run_ranks, n):
    ranks = torch.arange(float(n))
    for d0, d1, counts in run_ranks(_gathers, world_size=n):
        assert torch.equal(d0, ranks.repeat_interleave(2).view(2 * n, 1).expand(2 * n, 3))
        assert torch.equal(d1, ranks.repeat_interleave(3).view(1, 3 * n).expand(2, 3 * n))
        S = n * 6 * F32  # the gathered output
        assert counts == {"world/all_gather": {"calls": 2, "bytes": 2 * S,
                                               "wire_bytes": 2 * (n - 1) / n * S}}


@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter(run_ranks, n):
    offset = n * (n - 1) / 2
    for r, (d0, d1, counts) in enumerate(run_ranks(_reduce_scatters, world_size=n)):
        pos = torch.arange(2.0 * r, 2.0 * r + 2)  # this rank's two positions
        assert torch.equal(d0, (n * 10 * pos + offset).view(2, 1).expand(2, 3))
        assert torch.equal(d1, (n * 10 * pos + offset).view(1, 2).expand(3, 2))
        S = 2 * n * 3 * F32  # the full input
        assert counts == {"world/reduce_scatter": {"calls": 2, "bytes": 2 * S,
                                                   "wire_bytes": 2 * (n - 1) / n * S}}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_all_to_all(run_ranks, n, uneven):
    for r, (rows_in, out, out_splits, payload, wire) in enumerate(
            run_ranks(_all_to_all, uneven, world_size=n)):
        expected = torch.cat([torch.full((k, 2), 100.0 * i + r) for i, k in enumerate(out_splits)])
        assert torch.equal(out, expected)
        kept = (r + r + 1) if uneven else 2  # the rows a rank sends to itself never leave it
        assert payload == rows_in * 2 * F32
        assert wire == (rows_in - kept) * 2 * F32


def test_reduce_scatter_and_all_to_all_reject_indivisible(run_ranks):
    for msgs in run_ranks(_indivisible, world_size=2):
        assert len(msgs) == 2 and all("not divisible" in m for m in msgs), msgs


def _value_errors(*calls) -> list[str]:
    """Each call's ValueError message, or "no error"."""
    msgs = []
    for fn in calls:
        try:
            fn()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def _indivisible():
    g = _world()
    return _value_errors(lambda: comm.reduce_scatter(torch.ones(3), g),
                         lambda: comm.all_to_all(torch.ones(3), g))


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_send_recv_exchange(run_ranks, n):
    for r, res in enumerate(run_ranks(_broadcast_and_p2p, world_size=n)):
        t, payload, wire = res["broadcast"]
        assert torch.equal(t, torch.full((5,), float(n - 1)))
        assert (payload, wire) == (5 * F32, 5 * F32)

        msg, counts = res["p2p"]
        S = 4 * F32
        if r == 0:
            assert counts == {"world/send": {"calls": 1, "bytes": S, "wire_bytes": S}}
        elif r == 1:
            assert torch.equal(msg, torch.full((4,), 7.0))
            assert counts == {"world/recv": {"calls": 1, "bytes": S, "wire_bytes": 0.0}}
        else:
            assert counts == {}

        got, counts = res["ring"]
        assert torch.equal(got, torch.full((3,), float((r - 1) % n)))
        S = 3 * F32
        assert counts == {"world/send": {"calls": 1, "bytes": S, "wire_bytes": S},
                          "world/recv": {"calls": 1, "bytes": S, "wire_bytes": 0.0}}


def test_counters_nest_and_single_groups_count_nothing(run_ranks):
    n = 2
    S = 8 * F32
    for outer, inner, same, single in run_ranks(_nested_and_single, world_size=n):
        ar_wire = 2 * (n - 1) / n * S
        assert inner == {
            "world/all_gather": {"calls": 1, "bytes": n * S, "wire_bytes": (n - 1) / n * n * S},
            "world/all_reduce": {"calls": 1, "bytes": S, "wire_bytes": ar_wire}}
        assert outer == {
            "world/all_gather": inner["world/all_gather"],
            "world/all_reduce": {"calls": 2, "bytes": 2 * S, "wire_bytes": 2 * ar_wire},
            "world/broadcast": {"calls": 1, "bytes": S, "wire_bytes": S}}
        assert all(same) and single == {}


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_is_reduce_scatter_plus_all_gather(run_ranks, n):
    for diff, scale, wire_ar, wire_two, S, S_rs, S_ag in run_ranks(_identity, world_size=n):
        assert diff <= 1e-6 * scale
        assert wire_ar == wire_two == 2 * (n - 1) / n * S
        assert S == S_rs == S_ag == 8 * 5 * F32


def test_unknown_reduction_is_rejected(run_ranks):
    assert run_ranks(_bad_op, world_size=2) == [True, True]


def _bad_op():
    try:
        comm.all_reduce(torch.ones(2), _world(), op="prod")
    except ValueError as e:
        return "use one of sum, max, min, avg" in str(e)
    return False


def _strided_in_place():
    """In-place operations on a transposed view: the result lands in the caller's tensor."""
    g, r, n = _world(), dist.get_rank(), dist.get_world_size()
    out = {}
    base = torch.arange(6.0).view(2, 3)
    t = (base + r).t()                                  # [3, 2], not contiguous
    out["all_reduce"] = comm.all_reduce(t, g).clone()
    t = (base + r).t()
    comm.broadcast(t, g, src=n - 1)
    out["broadcast"] = t.clone()
    got = torch.zeros(2, 3).t()
    comm.exchange([P2P("send", (base + r).t(), (r + 1) % n), P2P("recv", got, (r - 1) % n)], g)
    out["exchange"] = got.clone()
    got = torch.zeros(2, 3).t()
    if r == 0:
        comm.send((base + 100).t(), g, dst=1)
    elif r == 1:
        comm.recv(got, g, src=0)
    out["recv"] = got.clone()
    return out


@pytest.mark.parametrize("n", SIZES)
def test_in_place_operations_accept_strided_tensors(run_ranks, n):
    base = torch.arange(6.0).view(2, 3).t()
    for r, out in enumerate(run_ranks(_strided_in_place, world_size=n)):
        assert torch.equal(out["all_reduce"], n * base + n * (n - 1) / 2)
        assert torch.equal(out["broadcast"], base + n - 1)
        assert torch.equal(out["exchange"], base + (r - 1) % n)
        if r == 1:
            assert torch.equal(out["recv"], base + 100)


def _bad_groups_and_splits():
    g = _world()
    return _value_errors(lambda: Group("elsewhere", [98, 99]).rank,
                         lambda: comm.all_to_all(torch.ones(4, 2), g, [2, 2], [1, 1, 2]),
                         lambda: comm.all_to_all(torch.ones(4, 2), g, [2, 2], [1, 1]))


def test_bad_group_and_split_sizes_say_what_is_wrong(run_ranks):
    for r, (outside, count, total) in enumerate(run_ranks(_bad_groups_and_splits, world_size=2)):
        assert f"rank {r} is not in group 'elsewhere' [98, 99]" in outside
        assert "input_split_sizes [1, 1, 2] must hold 2 counts" in count
        assert "input_split_sizes [1, 1] sum to 2, but dim 0 of the input is 4" in total


def _p2p_with_oneself():
    g, r, n = _world(), dist.get_rank(), dist.get_world_size()
    one = comm.single_group()
    mine, got = torch.full((3,), float(r)), torch.zeros(3)
    with comm.counting() as c:   # a ring of one rank: the message comes straight back
        comm.exchange([P2P("send", mine, 0), P2P("recv", got, 0)], one)
    msgs = _value_errors(lambda: comm.send(mine, one, 0), lambda: comm.recv(got, g, r),
                         lambda: comm.send(mine, g, n), lambda: comm.exchange([P2P("send", mine, r)], g))
    return got, c.as_dict(), msgs


def test_point_to_point_with_oneself(run_ranks):
    for r, (got, counts, msgs) in enumerate(run_ranks(_p2p_with_oneself, world_size=2)):
        assert torch.equal(got, torch.full((3,), float(r))) and counts == {}
        assert "send: peer 0 must be another rank of group 'self' (0..0, not this rank's 0)" in msgs[0]
        assert f"recv: peer {r} must be another rank of group 'world'" in msgs[1]
        assert "send: peer 2 must be another rank of group 'world' (0..1" in msgs[2]
        assert "exchange: 1 sends but 0 receives with this rank itself as the peer" in msgs[3]
