"""Tensor-parallel communication overlapped with the GEMMs (tensor_parallel/overlap.py).

The chunked ring must compute what plain sequence parallelism computes (outputs, dL/dx, every
weight and bias gradient, within float32 tolerance of the single-device layer and of plain
SP), send the same bytes, refuse the settings it cannot serve, and a chunk filed under the
wrong rank must be caught. Sizes 2 and 4: at 2 the left and right neighbours are one rank,
so only 4 tells a ring that turns the wrong way from one that turns the right way.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minitron.grid import ParallelConfig, build_grid
from minitron.config import ConfigError, ModelConfig
from minitron.runtime import comm
from minitron.tensor_parallel import overlap
from minitron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from minitron.train import cli as train_cli
from minitron.verify import cli as verify_cli
from minitron.verify.compare import rel_err
from minitron.verify.plants import Plant
from minitron.verify.run import verify

B, S, H, FFN = 2, 8, 16, 32
F32 = 4
TOL = 1e-5


def _full(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seq(t, group):
    return t.chunk(group.size, dim=1)[group.rank]


def _mlp_rank(overlapped: bool, wrong_chunk: bool = False):
    """Column(h -> ffn) -> GeLU -> Row(ffn -> h) under SP on every rank: its errors against one
    nn.Linear pair, its wire bytes per (direction, operation), and its timeline's events."""
    group = build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=True)).tp
    n, r = group.size, group.rank
    W1, b1, W2, b2 = _full((FFN, H), 1), _full((FFN,), 2), _full((H, FFN), 3), _full((H,), 4)
    X, G = _full((B, S, H), 5), _full((B, S, H), 6)
    l1, l2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
    fc1 = ColumnParallelLinear(H, FFN, group, sequence_parallel=True, comm_overlap=overlapped)
    fc2 = RowParallelLinear(FFN, H, group, sequence_parallel=True, comm_overlap=overlapped)
    with torch.no_grad():
        for lin, w, b in ((l1, W1, b1), (l2, W2, b2)):
            lin.weight.copy_(w), lin.bias.copy_(b)
        fc1.weight.copy_(W1.chunk(n, 0)[r]), fc1.bias.copy_(b1.chunk(n, 0)[r])
        fc2.weight.copy_(W2.chunk(n, 1)[r]), fc2.bias.copy_(b2)
    ref_x = X.clone().requires_grad_()
    y_ref = l2(F.gelu(l1(ref_x)))
    (y_ref * G).sum().backward()
    x = _seq(X, group).clone().requires_grad_()
    with Plant("tp-overlap-chunk" if wrong_chunk else None).step():
        with overlap.recording() as events:
            with comm.counting() as fwd:
                y = fc2(F.gelu(fc1(x)))
            with comm.counting() as bwd:
                (y * _seq(G, group)).sum().backward()
    db2 = comm.all_reduce(fc2.bias.grad.clone(), group)    # each rank saw only its tokens
    errs = {"y": rel_err(y, _seq(y_ref, group)), "dx": rel_err(x.grad, _seq(ref_x.grad, group)),
            "dW1": rel_err(comm.all_gather(fc1.weight.grad, group, 0), l1.weight.grad),
            "db1": rel_err(comm.all_gather(fc1.bias.grad, group, 0), l1.bias.grad),
            "dW2": rel_err(comm.all_gather(fc2.weight.grad, group, 1), l2.weight.grad),
            "db2": rel_err(db2, l2.bias.grad)}
    wire = {(way, op): rec["wire_bytes"] for way, c in (("fwd", fwd), ("bwd", bwd))
            for op, rec in c.as_dict().items()}
    return errs, wire, [(kind, label) for kind, label, _, _ in events]


@pytest.mark.parametrize("n", [2, 4])
def test_overlapped_mlp_equals_plain_sp_and_sends_the_same_bytes(run_ranks, n):
    act = B * S * H * F32                      # one [b, s, h] activation, the SP messages' size
    ring = (n - 1) / n * act                   # what a ring all-gather / reduce-scatter sends
    plain = run_ranks(_mlp_rank, False, world_size=n)
    ours = run_ranks(_mlp_rank, True, world_size=n)
    for (p_errs, p_wire, _), (errs, wire, events) in zip(plain, ours):
        assert max(errs.values()) <= TOL, errs
        assert max(abs(errs[k] - p_errs[k]) for k in errs) <= TOL, (errs, p_errs)
        # per direction, what each rank sends: the same bytes as plain SP, and the formula
        for way in ("fwd", "bwd"):
            assert sum(v for (w, _), v in wire.items() if w == way) == \
                sum(v for (w, _), v in p_wire.items() if w == way) == 2 * ring
        assert wire[("fwd", "tp/send")] == wire[("bwd", "tp/send")] == 2 * ring
        assert set(wire) == {(w, f"tp/{op}") for w in ("fwd", "bwd") for op in ("send", "recv")}
        # 4 rings (2 forward, 2 backward): n GEMM chunks and n-1 messages each
        assert sum(kind == "gemm" for kind, _ in events) == 4 * n
        assert sum(kind == "comm" for kind, _ in events) == 4 * (n - 1)


def _deferred_rank():
    """The overlapped MLP under a zero-bubble schedule's split backward (weight_grad.py): B
    leaves dL/dW queued, W then gives the gradients a full backward gives."""
    from minitron.tensor_parallel import weight_grad
    group = build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=True)).tp
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(H, FFN, group, sequence_parallel=True, comm_overlap=True)
    fc2 = RowParallelLinear(FFN, H, group, sequence_parallel=True, comm_overlap=True)
    x = _seq(_full((B, S, H), 5), group)
    grads = []
    for split in (False, True):
        for p in (fc1.weight, fc2.weight):
            p.grad = None
        with weight_grad.capture():
            y = fc2(F.gelu(fc1(x)))
        with weight_grad.deferring("mb0") if split else contextlib.nullcontext():
            y.sum().backward()
        queued = all(p.grad is None for p in (fc1.weight, fc2.weight))
        ran = weight_grad.STORE.pop("mb0")
        grads.append((queued, ran, fc1.weight.grad.clone(), fc2.weight.grad.clone()))
    (q0, ran0, a1, a2), (q1, ran1, b1, b2) = grads
    return q0, ran0, q1, ran1, max(rel_err(b1, a1), rel_err(b2, a2))


def test_weight_gradients_defer_for_zero_bubble(run_ranks):
    for queued_full, ran_full, queued, ran, err in run_ranks(_deferred_rank, world_size=2):
        assert not queued_full and ran_full == 0         # a full backward computes dL/dW at once
        assert queued and ran == 2 and err <= TOL        # B queued both; W ran them, same grads


@pytest.mark.parametrize("n", [2, 4])
def test_a_chunk_filed_under_the_wrong_rank_is_caught(run_ranks, n):
    for errs, _, _ in run_ranks(_mlp_rank, True, True, world_size=n):
        assert errs["y"] > 1e3 * TOL and errs["dx"] > 1e3 * TOL, errs


def test_the_model_verifies_and_its_plant_fails():
    """The whole GPT through the verifier (every gradient, the updates) with the overlap on."""
    pcfg = ParallelConfig(tp=2, sequence_parallel=True, tp_comm_overlap=True)
    mcfg = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=1, n_heads=4, dropout=0.1)
    assert verify(pcfg, mcfg, steps=1).passed
    assert not verify(pcfg, mcfg, steps=1, plant="tp-overlap-chunk").passed


def test_refused_without_sequence_parallelism(capsys, monkeypatch):
    with pytest.raises(ConfigError, match=r"tp_comm_overlap=True hides .*: without SP "
                                          r"\(sequence_parallel=False\) there are none; use sequence_parallel=True or tp_comm_overlap=False"):
        ParallelConfig(tp=2, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        RowParallelLinear(8, 8, comm.single_group(), comm_overlap=True)

    def launched(*args, **kwargs):
        raise AssertionError("a rank was started for options that should have been refused")
    monkeypatch.setattr("minitron.verify.run.launch", launched)
    monkeypatch.setattr("minitron.train.restart.launch", launched)
    assert verify_cli.main(["--tp", "2", "--tp-comm-overlap"]) == 2
    err = capsys.readouterr().err
    assert "--tp-comm-overlap" in err and "use --sp or drop --tp-comm-overlap" in err, err
    assert train_cli.main(["--tp", "2", "--tp-comm-overlap", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "use --sp or drop --tp-comm-overlap" in err, err


def test_bench_figures_from_a_timeline():
    """GEMM chunks 0-4 and 5-9 ms; a message 1-6 ms (4 of 5 inside a GEMM), one 9-11 (none)."""
    from minitron.bench import tp_overlap
    events = [("gemm", "a chunk 0", 0.0, 4.0), ("comm", "a message 0", 1.0, 6.0),
              ("gemm", "a chunk 1", 5.0, 9.0), ("comm", "b message 0", 9.0, 11.0)]
    figures = tp_overlap.summarize({"span": (0.0, 12.0), "events": events})
    assert figures == pytest.approx({"step": 12.0, "comm": 7.0, "inside": 4.0, "exposed": 3.0,
                                     "gemm": 8.0, "hidden": 4 / 7})
    lines = tp_overlap.timeline({"span": (0.0, 12.0), "events": events}, width=12)
    assert [line.split("|")[0].strip() for line in lines] == [
        "GEMM a chunk 0", "a message 0", "GEMM a chunk 1", "b message 0"]
    assert lines[1].split("|")[1] == " " + "#" * 5 + " " * 6


def test_bench_runs_and_reports(capsys):
    from minitron.bench import tp_overlap
    tiny = {"batch": 1, "seq": 16, "hidden": 32, "ffn": 64}
    figures = tp_overlap.run(tiny, repeats=1)
    out = capsys.readouterr().out
    assert 0.0 <= figures["hidden"] <= 1.0
    assert "TP communication hidden behind the GEMMs" in out and "plain SP" in out, out
    assert out.count("  GEMM ") == 8 and out.count(" message 0 ") == 4, out
