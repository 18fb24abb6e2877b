"""ZeRO-3 inside pipeline stages: each pipeline rank shards its own stages over its dp group.

Numbers: verify's rows (logits, loss, dL/dX, every gradient at the float32 bar, every updated
weight at the update bar, replicas bitwise) for dp 2 x pp 2 under 1F1B and ZB-H1 (B/W split:
the deferred W runs on freed weights), and tp 2 + SP x pp 2; the planted stale gather fails.
Memory: a bf16 pipeline rank's parameter, gradient and optimizer bytes after a step equal the
ZeRO paper's 16 Ψ_rank / N exactly (Ψ_rank: that rank's stages), and no full gradient is alive
once the schedule has run (micro-batches accumulate in the shard, zero3.py).
Traffic: the step's data-parallel wire bytes equal 3m (N-1)/N * 2 Ψ_rank exactly, every unit is
gathered 2m times, always to the same values.
"""
import pytest
import torch

from minitron.runtime import comm
from minitron.train.step import replica_rows
from minitron.data_parallel import (ZeroOptimizer, ZeroStage3, formula_bytes, measure,
                                    traffic_wire_bytes)
from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig
from minitron.pipeline.executor import run_schedule
from minitron.model.stages import PipelineGPT
from minitron.pipeline.schedules import make_schedule
from minitron.verify import Report, make_batch, run_rank
from minitron.train.engine import check_supported

BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4)
M = 4            # micro-batches


def _verify(run_ranks, pcfg, schedule, plant=None, **opts):
    sched = make_schedule(schedule, pcfg.pp, M)
    mcfg = ModelConfig(**{**BASE, **opts})
    batch = M * pcfg.dp                    # one sample per micro-batch per replica
    return Report(run_ranks(run_rank, pcfg, mcfg, 2, torch.float32, 0, 1e-4, 1e-6, batch, None,
                            plant, sched, 3, world_size=pcfg.world_size)[0])


@pytest.mark.parametrize("pcfg, schedule, opts", [
    (ParallelConfig(dp=2, pp=2), "1f1b", dict(dropout=0.1)),
    (ParallelConfig(dp=2, pp=2), "zb-h1", {}),
    (ParallelConfig(tp=2, sequence_parallel=True, pp=2), "1f1b",
     dict(norm="rmsnorm", activation="swiglu", position="rope")),
], ids=["dp2-pp2-1f1b", "dp2-pp2-zb-h1", "tp2-sp-pp2-1f1b"])
def test_zero3_in_pipeline_passes_verify(run_ranks, pcfg, schedule, opts):
    report = _verify(run_ranks, pcfg, schedule, **opts)
    assert report.passed, report.table()
    kinds = {r.quantity.split(" ")[0] for r in report.rows}
    assert {"logits", "loss", "dL/dX", "grad", "weight", "replicas"} <= kinds, kinds


def test_stale_gather_is_caught_under_pipeline(run_ranks):
    """zero-gather at stage 3: each rank's gathers refresh only its own shard; the next step's
    forward runs on its peers' old pieces, so step 1 fails (step 0 saw fresh weights)."""
    report = _verify(run_ranks, ParallelConfig(dp=2, pp=2), "1f1b", plant="zero-gather")
    assert not report.passed
    assert {r.step for r in report.failures} == {1}, report.table()
    assert any(r.quantity == "logits" for r in report.failures), report.table()


def test_refusals_left():
    sched = make_schedule("1f1b", 2, M)
    pcfg = ParallelConfig(dp=2, pp=2)
    check_supported(pcfg, ModelConfig(**BASE), torch.float32, 3, sched)   # built now
    check_supported(pcfg, ModelConfig(**BASE, tie_embeddings=True), torch.float32, 3, sched)
    with pytest.raises(ValueError, match="use schedule='1f1b'"):    # one rank, both stages
        check_supported(pcfg, ModelConfig(**{**BASE, "n_layers": 4}, tie_embeddings=True), torch.float32,
                        3, make_schedule("zb-v", 2, M))


# ---- memory and traffic, exactly ------------------------------------------------------------
def pipeline_memory_rank(schedule_name):
    pcfg = ParallelConfig(dp=2, pp=2)
    grid, mcfg = build_grid(pcfg), ModelConfig(**BASE)
    schedule = make_schedule(schedule_name, pcfg.pp, M)
    model = PipelineGPT(mcfg, grid, schedule.stage_rank, seed=0).to(torch.bfloat16)
    psi_rank = sum(p.numel() for p in model.parameters())
    engine = ZeroStage3(model, grid)
    opt = ZeroOptimizer(engine, lr=1e-3)
    gathered = {id(u): [] for u in engine.units}       # every gather's values, per unit
    for u in engine.units:
        def gather(u=u, real=u.gather):
            if not u.gathered:
                real()
                gathered[id(u)].append(u.full.detach().clone())
        u.gather = gather
    tokens, targets = make_batch(0, 0, M * grid.dp.size, mcfg.seq_len, mcfg.vocab_size)
    rows = replica_rows(tokens.shape[0], grid, M)
    engine.zero_grad()
    model.rng.reset(0)
    with comm.counting() as c:
        with engine.no_sync():
            run_schedule(schedule, model, tokens[rows], targets[rows], rows=rows,
                         keep_outputs=False, finalize_grads=False)
        full_grads_alive = sum(p.grad is not None for p in model.parameters())
        engine.finish_grad_sync()
        opt.step()
    same = all(all(torch.equal(g, gs[0]) for g in gs) for gs in gathered.values())
    engine.remove_hooks()
    return dict(psi=psi_rank, padded=engine.padded_numel, mem=measure(model, engine, opt),
                wire=c.wire_bytes(group="dense_dp"), gathers={len(g) for g in gathered.values()},
                reduce_scatters=c.calls("reduce_scatter", "dense_dp"), units=len(engine.units),
                full_grads_alive=full_grads_alive, same_values=same, stages=model.stages)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_rank_memory_and_traffic_equal_the_formulas(run_ranks, schedule):
    per_rank = run_ranks(pipeline_memory_rank, schedule, world_size=4)
    assert {tuple(got["stages"]) for got in per_rank} == {(0,), (1,)}
    for got in per_rank:
        psi, n = got["psi"], 2
        assert got["padded"] == psi                     # every unit divides by N at this shape
        assert got["mem"] == formula_bytes(psi, n, 3), (got["mem"], formula_bytes(psi, n, 3))
        assert got["mem"].total == 16 * psi // n
        assert got["wire"] == traffic_wire_bytes(psi, n, 3, microbatches=M)
        assert got["gathers"] == {2 * M} and got["same_values"]     # forward + backward, each mb
        assert got["reduce_scatters"] == M * got["units"]
        assert got["full_grads_alive"] == 0             # every micro-batch already in the shard
    assert len({got["psi"] for got in per_rank}) == 2      # the two stages differ: each its own Ψ
