"""Context parallelism inside pipeline stages (cp x pp) against the single-device reference.

Every cp rank of a stage runs the schedule on its zigzag chunks of each micro-batch's sequences
(pipeline/executor.py), messages between stages carry s/cp tokens between ranks of equal
(tp, cp, dp) coordinates, and the verifier's per-rank body (verify.run_rank) compares logits,
loss, dL/dX (gathered back over cp), every gradient (averaged over cp, tied copies summed over
the first and last stage) and every update at its float32 tolerances, dropout 0.1 (masks keyed
by the tokens' global rows and positions). The planted chunk order fails under a pipeline too;
the bytes between stages are the formula with s/cp per message, exactly; the (micro-batch,
stage) pairs alive at the measured peak are the schedule checker's prediction; a recomputation
mode that CP lacks is refused before any rank starts.
"""
import pytest

from minitron.runtime import comm
from minitron import verify
from minitron.verify import cli as verify_cli
from minitron.grid import ParallelConfig, build_grid
from minitron.model.splits import validate_model
from minitron.model import ModelConfig
from minitron.pipeline import executor
from minitron.pipeline.check import check
from minitron.model.stages import PipelineGPT
from minitron.pipeline.schedules import make_schedule
from minitron.verify import Report, make_batch, run_rank

BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
CP, PP, M = 2, 2, 4
CASES = {
    # name: (schedule, virtual, model options); tied: the embedding's two copies summed over pp
    "1f1b-tied": ("1f1b", 1, dict(tie_embeddings=True)),
    "zb-h1": ("zb-h1", 1, {}),                              # B and W split
    "interleaved": ("interleaved", 2, dict(n_layers=4)),     # two chunks per rank
}


def _report(run_ranks, name, plant=None, steps=2):
    schedule, virtual, opts = CASES[name]
    sched = make_schedule(schedule, PP, M, virtual)
    pcfg = ParallelConfig(cp=CP, pp=PP, virtual_pp=sched.virtual)
    rows = run_ranks(run_rank, pcfg, ModelConfig(**{**BASE, **opts}), steps, batch=M, plant=plant,
                     schedule=sched, world_size=pcfg.world_size)[0]
    return Report(rows)


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_inside_pipeline_matches_reference(run_ranks, name):
    report = _report(run_ranks, name)
    assert report.passed, report.verdict() + "\n" + report.table()
    quantities = {r.quantity for r in report.rows}
    assert {"logits", "loss", "dL/dX", "replicas grads", "replicas weights"} <= quantities
    assert all(r.err == 0.0 for r in report.rows if r.quantity.startswith("replicas"))


def test_wrong_chunk_order_fails_inside_pipeline(run_ranks):
    """Test of the test: the executor cuts the batch contiguously while the model assumes zigzag."""
    report = _report(run_ranks, "zb-h1", plant="cp-chunk-order", steps=1)
    assert not report.passed
    failed = {r.quantity for r in report.failures}
    assert {"dL/dX", "logits"} <= failed, report.table()


# ---- messages: s/cp tokens per message, counted exactly ---------------------------------------------
def _traffic_worker():
    sched = make_schedule("1f1b", PP, M)
    cfg = ModelConfig(**BASE)
    grid = build_grid(ParallelConfig(cp=CP, pp=PP))
    model = PipelineGPT(cfg, grid, sched.stage_rank)
    tokens, targets = make_batch(0, 0, M, cfg.seq_len, cfg.vocab_size)
    model.rng.reset(0)
    with comm.counting() as counts:
        executor.run_schedule(sched, model, tokens, targets, keep_outputs=False)
    return {k: (v["calls"], v["bytes"]) for k, v in counts.as_dict().items() if k.startswith("pp/")}


def test_bytes_between_stages_are_the_formula_with_s_over_cp(run_ranks):
    """pp = 2: one boundary; per micro-batch one activation forward and one gradient backward,
    each mb * (s/cp) * h * 4 bytes, sent by every cp rank to its own peer on the other stage."""
    message = 1 * (BASE["seq_len"] // CP) * BASE["hidden"] * 4    # one sequence per micro-batch
    for got in run_ranks(_traffic_worker, world_size=CP * PP):
        assert got == {"pp/send": (M, M * message), "pp/recv": (M, M * message)}, got


# ---- memory: the schedule's prediction still holds, in micro-batches alive --------------------------
def _memory_worker(name):
    sched = make_schedule(name, PP, M)
    grid = build_grid(ParallelConfig(cp=CP, pp=PP))
    model = PipelineGPT(ModelConfig(**BASE), grid, sched.stage_rank)
    tokens, targets = make_batch(0, 0, M, BASE["seq_len"], BASE["vocab_size"])
    model.rng.reset(0)
    result = executor.run_schedule(sched, model, tokens, targets, keep_outputs=False, track_memory=True)
    return result.peak_alive, result.peak_bytes, set(result.unit_bytes.values())


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_peak_activations_are_the_checkers_prediction(run_ranks, name):
    """cp splits every (micro-batch, stage)'s activations, not how many the schedule keeps."""
    predicted = check(make_schedule(name, PP, M)).peak_activations
    for rank, (alive, peak_bytes, units) in enumerate(run_ranks(_memory_worker, name, world_size=CP * PP)):
        pp_rank = rank // CP                     # tp = 1: rank = cp_rank + cp * pp_rank
        assert alive == predicted[pp_rank], (rank, alive, predicted)
        assert len(units) == 1 and 0 < peak_bytes <= alive * max(units)
        if name == "1f1b":                       # F and BW only: whole graphs alive, nothing else
            assert peak_bytes == alive * max(units)


# ---- refused up front ---------------------------------------------------------------------------------
def test_selective_recompute_with_cp_is_refused_before_any_rank_starts(capsys, monkeypatch):
    with pytest.raises(ValueError, match="selective recomputation of context-parallel attention"):
        validate_model(ParallelConfig(cp=2), ModelConfig(**BASE, recompute="selective"))
    monkeypatch.setattr(verify.run, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    assert verify_cli.main(["--tp", "1", "--cp", "2", "--pp", "2", "--recompute", "selective"]) == 2
    assert "use --recompute full or --recompute none or --cp 1" in capsys.readouterr().err
