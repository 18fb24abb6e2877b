"""ZeRO stages 1, 2 and 3: the reference's AdamW, the paper's memory and traffic, torch's peers.

Numbers: test_data_parallel.dp_rank (gradients against the reference on the whole global
batch at the float32 bar, updated weights against torch.optim.AdamW at the update bar).
Memory: every stage's per-rank bytes of parameters, gradients and optimizer state, measured
from the storages a bf16 model with fp32 master weights holds after a step, equal the ZeRO
paper's formulas exactly (Ψ = 29,824 parameters, which every bucket and unit divides by N).
Traffic: the data-parallel wire bytes of a step, counted by minitron.runtime.comm, equal the formulas.
Peers: torch's ZeroRedundancyOptimizer (ZeRO-1) and FSDP2's fully_shard (ZeRO-3).
"""
import pytest
import torch

from minitron.runtime import comm
from minitron.data_parallel import (DataParallel, ZeroOptimizer, ZeroStage3, formula_bytes,
                                    gathered_params, measure, traffic_wire_bytes, wrap)
from minitron.train.step import forward_backward
from minitron.grid import ParallelConfig, build_grid
from minitron.model import GPT, ModelConfig, ParallelGPT
from minitron.verify import make_batch
from minitron.verify.checks import update_err, update_tolerance
from test_data_parallel import BASE, EPS, LR, SEED, _failures, dp_rank

CASES = {
    # name: (parallel config, zero stage, model options, world size)
    "zero1-dp2": (ParallelConfig(dp=2), 1, dict(dropout=0.1), 2),
    "zero2-dp2": (ParallelConfig(dp=2), 2, dict(dropout=0.1), 2),
    "zero1-dp4": (ParallelConfig(dp=4), 1, {}, 4),
    "zero2-dp4": (ParallelConfig(dp=4), 2, {}, 4),
    "zero1-dp2-tp2-sp": (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 1, dict(dropout=0.1), 4),
    "zero3-dp2": (ParallelConfig(dp=2), 3, dict(dropout=0.1), 2),
    "zero3-dp4": (ParallelConfig(dp=4), 3, {}, 4),
    "zero3-dp2-tp2-sp": (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 3,
                         dict(norm="rmsnorm", activation="swiglu", position="rope"), 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_zero_matches_reference(run_ranks, name):
    pcfg, stage, opts, world = CASES[name]
    mcfg = ModelConfig(**{**BASE, **opts})
    # 2 steps, 2 micro-batches, global batch 8, buckets of ~4096 elements
    rows, info = run_ranks(dp_rank, pcfg, mcfg, stage, 2, 2, 8, 4096, world_size=world)[0]
    assert not _failures(rows), "\n".join(_failures(rows))
    kinds = {r.quantity.split(" ")[0] for r in rows}
    assert {"grad", "weight"} <= kinds


@pytest.mark.parametrize("stage, plant, caught", [(1, "skip_all_gather", "weight"),
                                                  (2, "no_divide", "grad"), (3, "no_divide", "grad")])
def test_planted_bug_is_caught(run_ranks, stage, plant, caught):
    rows, _ = run_ranks(dp_rank, ParallelConfig(dp=2), ModelConfig(**BASE), stage, 1, 1, 4, 4096,
                        plant, world_size=2)[0]
    assert [r for r in rows if not r.ok and r.quantity.startswith(caught)], f"{plant} unnoticed"


# ---- memory and traffic, exactly ------------------------------------------------------------
def memory_rank(n, stages):
    grid = build_grid(ParallelConfig(dp=n))
    mcfg = ModelConfig(**BASE)
    tokens, targets = make_batch(0, SEED, 2 * n, mcfg.seq_len, mcfg.vocab_size)
    out = {}
    for stage in stages:
        model = ParallelGPT(mcfg, grid, seed=SEED).to(torch.bfloat16)
        psi = sum(p.numel() for p in model.parameters())
        engine, opt = wrap(model, grid, stage, bucket_numel=None, lr=LR, eps=EPS)
        engine.zero_grad()
        with comm.counting() as c:
            forward_backward(model, None, tokens, targets, 0, engine=engine)
            opt.step()
        mem = measure(model, engine, opt)
        loss_mean = c.wire_bytes(group="ep_dp")         # the step's loss, averaged over replicas
        out[stage] = dict(psi=psi, padded=engine.padded_numel, mem=mem, loss_mean=loss_mean,
                          wire=c.wire_bytes(group="dense_dp"),
                          other=c.wire_bytes() - c.wire_bytes(group="dense_dp") - loss_mean,
                          master_dtype=opt.master.dtype, param_dtype=next(model.parameters()).dtype)
        engine.remove_hooks()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_memory_and_traffic_equal_the_formulas(run_ranks, n):
    for per_rank in run_ranks(memory_rank, n, [0, 1, 2, 3], world_size=n):
        for stage, got in per_rank.items():
            psi = got["psi"]
            assert psi == 29_824 and got["padded"] == psi     # no padding at this shape
            assert got["param_dtype"] == torch.bfloat16 and got["master_dtype"] == torch.float32
            assert got["mem"] == formula_bytes(psi, n, stage), (stage, got["mem"])
            assert got["wire"] == traffic_wire_bytes(psi, n, stage), (stage, got["wire"])
            assert got["other"] == 0 and got["loss_mean"] == 2 * (n - 1) / n * 4   # one float32
    per_rank = per_rank  # the last rank's: stage 3's traffic is 1.5 times plain DP's
    assert per_rank[3]["wire"] == 1.5 * per_rank[0]["wire"] == 1.5 * per_rank[1]["wire"]


def test_formula_table():
    psi, n = 1_000, 4
    assert formula_bytes(psi, n, 0).total == 16 * psi
    assert formula_bytes(psi, n, 1).total == 4 * psi + 12 * psi // n
    assert formula_bytes(psi, n, 2).total == 2 * psi + 14 * psi // n
    assert formula_bytes(psi, n, 3).total == 16 * psi // n
    with pytest.raises(ValueError, match="padded"):
        formula_bytes(1001, 4, 1)


# ---- peers -------------------------------------------------------------------------------
# ZeroOptimizer steps with torch's fused CPU AdamW kernel (minitron/kernels/ops.py), so the peers
# step with it too: two steps on gradients each side computes itself need the same rounding in
# step 1, or a tensor whose gradient is float32 noise (a key bias: softmax ignores it) takes a
# different step 2. Every tensor here is a multiple of 16 elements, so torch's per-parameter
# calls round every element as ZeroOptimizer's one call over the shard does.
FUSED = hasattr(torch, "_fused_adamw_")
def _compare(mine: dict, theirs: dict, old: dict) -> list[str]:
    tol = update_tolerance()
    bad = []
    for name, t in theirs.items():
        err = update_err(mine[name], old[name], t, old[name])
        if not err <= tol:
            bad.append(f"{name}: {err:.2e} > {tol:.1e}")
    return bad


def zero1_peer_rank(steps=2):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    mcfg = ModelConfig(**BASE)
    grid = build_grid(ParallelConfig(dp=2))
    mine, theirs = GPT(mcfg, SEED), GPT(mcfg, SEED)
    engine = DataParallel(mine, grid, bucket_numel=4096, zero_stage=1)
    opt = ZeroOptimizer(engine, lr=LR, eps=EPS)
    ddp = DistributedDataParallel(theirs)
    zro = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, eps=EPS,
                                  fused=FUSED)
    bad = []
    for step in range(steps):
        tokens, targets = make_batch(step, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
        rows = slice(2 * grid.dp.rank, 2 * grid.dp.rank + 2)
        old = {n: p.detach().clone() for n, p in theirs.named_parameters()}
        engine.zero_grad()
        mine(tokens[rows], targets[rows])[1].backward()
        engine.finish_grad_sync()
        opt.step()
        zro.zero_grad()
        ddp(tokens[rows], targets[rows])[1].backward()
        zro.step()
        bad += _compare(gathered_params(engine), {n: p.detach() for n, p in theirs.named_parameters()}, old)
    return bad


def test_zero1_equals_torch_zero_redundancy_optimizer(run_ranks):
    for bad in run_ranks(zero1_peer_rank, world_size=2):
        assert not bad, "\n".join(bad)


def zero3_peer_rank(steps=2):
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        return f"skip: FSDP2 (fully_shard) is not in this torch: {e}"
    mcfg = ModelConfig(**{**BASE, "bias": False})
    grid = build_grid(ParallelConfig(dp=2))
    mine, theirs = ParallelGPT(mcfg, grid, seed=SEED), ParallelGPT(mcfg, grid, seed=SEED)
    mesh = init_device_mesh("cpu", (2,))
    for layer in theirs.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    engine = ZeroStage3(mine, grid)
    opt = ZeroOptimizer(engine, lr=LR, eps=EPS)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=LR, eps=EPS, fused=FUSED)
    full = lambda: {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}
    bad = []
    for step in range(steps):
        tokens, targets = make_batch(step, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
        rows = slice(2 * grid.dp.rank, 2 * grid.dp.rank + 2)
        old = full()
        engine.zero_grad()
        mine(tokens[rows], targets[rows])[1].backward()
        engine.finish_grad_sync()
        opt.step()
        torch_opt.zero_grad()
        theirs(tokens[rows], targets[rows])[1].backward()
        torch_opt.step()
        bad += _compare(gathered_params(engine), full(), old)
    return bad


def test_zero3_equals_fsdp2(run_ranks):
    for bad in run_ranks(zero3_peer_rank, world_size=2):
        if isinstance(bad, str):
            pytest.skip(bad)
        assert not bad, "\n".join(bad)


def one_unit_rank():
    grid = build_grid(ParallelConfig(dp=2))
    mcfg = ModelConfig(**BASE)
    model = ParallelGPT(mcfg, grid, seed=SEED)
    engine = ZeroStage3(model, grid)
    seen = []
    for u in engine.units:      # registered after the engine's: they run once the unit is gathered
        u.module.register_forward_pre_hook(
            lambda m, a: seen.append(sum(v.gathered for v in engine.units)))
    tokens, targets = make_batch(0, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
    engine.zero_grad()
    with comm.counting() as c:
        forward_backward(model, None, tokens, targets, 0, engine=engine)
    after = sum(v.gathered for v in engine.units)
    return seen, after, c.calls("all_gather"), c.calls("reduce_scatter"), len(engine.units)


def test_zero3_holds_one_unit_at_a_time(run_ranks):
    seen, after, gathers, scatters, units = run_ranks(one_unit_rank, world_size=2)[0]
    assert seen == [1] * units and after == 0
    assert gathers == 2 * units and scatters == units    # forward, again for backward; grads once
