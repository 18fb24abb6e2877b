"""The verifier itself: it passes correct splits with a margin, and fails planted errors by name.

Correct runs at tp 1, 2, 3, 4 and 8 (the tp 8 one is the shape that once failed falsely);
planted errors (minitron.verify.plants.PLANTS): replicas drifting on rank 1, a 1% error in one
update, one gradient, one logit; the float32 tolerances measured against a float64 reference;
the command line.
"""
import copy
import math
import re
import subprocess
import sys

import pytest
import torch

from minitron.runtime import comm
from minitron import verify
from minitron.verify import cli as verify_cli
from minitron.grid import ParallelConfig, build_grid
from minitron.model import GPT, ModelConfig, ParallelGPT
from minitron.model.convert import grads_state_dict, rules
from minitron.verify.compare import rel_err
from minitron.verify import Report, Row, make_batch, reference_step, run_rank
from minitron.verify.checks import C_SUM, EPS32, grad_rows, longest_sum, replica_rows

SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False)
CORRECT = {
    # name: (tp, sequence_parallel, model options)
    "tp1": (1, False, {}),
    "tp2-sp-llama-gqa": (2, True, dict(LLAMA, n_kv_heads=2)),
    "tp3-sp": (3, True, dict(vocab_size=96, seq_len=12, hidden=48, n_heads=6)),
    "tp4-gqa-tied": (4, False, dict(n_heads=8, n_kv_heads=4, tie_embeddings=True, dropout=0.0)),
    # python -m minitron.verify --tp 8 --heads 8: once a false FAIL on attention.v.bias's update
    "tp8-heads8-default-shape": (8, False, dict(vocab_size=128, seq_len=16, hidden=64, n_heads=8)),
}


def _run(run_ranks, tp, sp=False, steps=2, plant=None, **opts):
    pcfg = ParallelConfig(tp=tp, sequence_parallel=sp)
    return Report(run_ranks(run_rank, pcfg, ModelConfig(**{**SMALL, **opts}), steps,
                            plant=plant, world_size=tp)[0])


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_split_passes_with_margin(run_ranks, name):
    tp, sp, opts = CORRECT[name]
    report = _run(run_ranks, tp, sp, **opts)
    assert report.passed, report.table()
    # Well inside the tolerance: within a quarter of it (C_SUM/4 units of sqrt(K) eps32).
    worst = report.worst(report.rows)
    assert worst.err <= worst.tol / 4, report.table()
    assert [r.err for r in report.rows if r.quantity.startswith("replicas")] == [0.0] * 4


# ---- replicas: bitwise identical across the ranks that hold them --------------------------------
def test_gradient_drift_on_rank_1_fails_naming_tensor_and_ranks(run_ranks):
    """The issue's repro: plain TP, rank 1 halves its norm gradients after finalize_grads."""
    report = _run(run_ranks, 2, steps=1, plant="replica-drift")
    assert [r.quantity for r in report.failures] == ["replicas grads"]   # rank 0's copy is right
    assert re.fullmatch(r"FAIL 1 of \d+ comparisons; worst: step 0 replicas grads: grad "
                        r"(layers\.\d\.(attn|mlp)_norm|final_norm)\.weight differs between tp ranks "
                        r"0 and 1 \(global ranks 0 and 1\): max rel diff 5\.00e-01", report.verdict())


def test_one_ulp_weight_drift_on_rank_1_fails(run_ranks):
    report = _run(run_ranks, 2, sp=True, steps=1, plant="weight-drift")
    assert [r.quantity for r in report.failures] == ["replicas weights"]
    assert ("worst: step 0 replicas weights: weight final_norm.weight differs between tp ranks 0 "
            "and 1 (global ranks 0 and 1): max rel diff 1.19e-07") in report.verdict()


def _replica_traffic(tp):
    cfg = ModelConfig(**SMALL)
    model = ParallelGPT(cfg, build_grid(ParallelConfig(tp=tp)))
    with comm.counting() as c:
        row, = replica_rows(0, "weights", model.state_dict(), cfg, model.grid)
    return c.as_dict(), row.err


@pytest.mark.parametrize("tp", [2, 4])
def test_replica_check_is_one_counted_all_gather(run_ranks, tp):
    """Every tensor not split along tp (rules' dim None), all-gathered once: tp copies of each."""
    whole = sum(GPT(ModelConfig(**SMALL)).state_dict()[r.parts[0]].numel()
                for r in rules(ModelConfig(**SMALL)) if r.dim is None)
    for traffic, err in run_ranks(_replica_traffic, tp, world_size=tp):
        assert err == 0.0
        assert {k: (v["calls"], v["bytes"]) for k, v in traffic.items()} == {
            "tp/all_gather": (1, tp * whole * 4)}


# ---- a 1% error in one tensor is caught, and nothing else is blamed -----------------------------
@pytest.mark.parametrize("plant,caught", [
    ("update", "weight layers.*.mlp.fc1.weight"),          # split over tp
    ("update:final_norm.weight", "weight final_norm.weight"),   # replicated, w = 1: coarsest
    ("grad", "grad layers.*.mlp.fc1.weight"),
    ("logit", "logits"),
])
def test_planted_one_percent_error_is_caught(run_ranks, plant, caught):
    report = _run(run_ranks, 2, steps=1, plant=plant)
    assert [r.quantity for r in report.failures] == [caught], report.table()
    row = report.failures[0]
    assert 5e-3 < row.err < 1.1e-2 and row.err > 100 * row.tol
    assert report.verdict().startswith(f"FAIL 1 of {len(report.rows)} comparisons; worst: step 0 "
                                       f"{caught}: rel_err={row.err:.2e} > tol=")


def test_unknown_plant_is_refused_before_launch():
    with pytest.raises(ValueError, match="unknown plant 'drift': choose one of"):
        verify.verify(ParallelConfig(tp=2), ModelConfig(**SMALL), plant="drift")


def test_per_rank_dropout_is_refused_before_launch():
    # Megatron's per-rank masks exist on no single device: a comparison would FAIL a correct split.
    with pytest.raises(ValueError, match="dropout_rng='per_rank': Megatron's per-rank dropout seeds draw masks no single device"):
        verify.verify(ParallelConfig(tp=2), ModelConfig(**SMALL, dropout_rng="per_rank"))


# ---- the float32 tolerance, measured against float64 -------------------------------------------
@pytest.mark.parametrize("opts", [{}, dict(LLAMA, n_kv_heads=2, hidden=64, n_heads=4),
                                  dict(vocab_size=256, seq_len=32, hidden=64, n_layers=3)])
def test_tolerance_covers_float32_with_margin_and_no_more(opts):
    """The float32 reference's own error (vs the same weights in float64, loss included) is
    what any correct float32 computation makes: the tolerance must sit above it with a margin
    of at least 4, and not more than 50 times above the largest (not lenient)."""
    cfg = ModelConfig(**{**SMALL, **opts})
    r32 = GPT(cfg, 0)
    r64 = copy.deepcopy(r32).double()
    tokens, targets = make_batch(0, 0, 2, cfg.seq_len, cfg.vocab_size)
    x32, logits32, loss32 = reference_step(r32, tokens, targets, 0)
    x64, logits64, loss64 = reference_step(r64, tokens, targets, 0, loss_dtype=torch.float64)
    errs = {"logits": rel_err(logits32, logits64), "loss": rel_err(loss32, loss64),
            "dL/dX": rel_err(x32.grad, x64.grad),
            "grad": max(r.err for r in grad_rows(0, grads_state_dict(r32), grads_state_dict(r64), 1.0))}
    tol = C_SUM * math.sqrt(longest_sum(cfg, 2, cfg.seq_len)) * EPS32
    assert all(4 * e <= tol for e in errs.values()), (tol, errs)
    assert tol <= 50 * max(errs.values()), (tol, errs)


# ---- the command line -------------------------------------------------------------------------
def test_cli_passes_on_tp2_sp_and_shows_margins():
    run = subprocess.run([sys.executable, "-m", "minitron.verify", "--tp", "2", "--sp", "--steps", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[-1].startswith("PASS max_rel_err=")
    assert float(lines[-1].split("=")[1]) <= 2e-6
    assert re.fullmatch(r"smallest margin: tol/err = \d+x \(step \d .+: \S+ vs tol 7\.6e-06\)", lines[-2])
    rows = [line for line in lines if line.split()[0] in ("0", "1")]
    assert {line.split()[0] for line in rows} == {"0", "1"}        # both steps reported
    assert all(line.endswith("yes") for line in rows)
    assert any("grad layers.*.mlp.fc1.weight" in line for line in rows)
    assert sum("replicas" in line for line in rows) == 4


def test_cli_planted_drift_exits_1(capsys):
    """main() in this process (the tests above and below run `python -m minitron.verify` itself):
    no interpreter, torch or minitron to start twice."""
    assert verify_cli.main(["--tp", "2", "--steps", "1", "--plant", "replica-drift"]) == 1
    out = capsys.readouterr().out
    assert "differs between tp ranks 0 and 1" in out.strip().splitlines()[-1], out
    with pytest.raises(SystemExit) as help_exit:
        verify_cli.main(["--help"])
    assert help_exit.value.code == 0
    assert "--plant" not in capsys.readouterr().out   # hidden


def test_expert_parallel_without_experts_exits_2(capsys):
    """Every dimension is built (the MoE runs are in tests/test_moe_verify.py); --ep alone has
    nothing to split."""
    assert verify_cli.main(["--ep", "2"]) == 2
    assert "a dense model has none" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--pp", "2", "--layers", "3"], "--layers 3 is not divisible by --pp 2 * --virtual 1"),
    (["--pp", "2", "--schedule", "zb-v"], "--layers 2 is not divisible by --pp 2 * --virtual 2"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual", "2", "--layers", "4",
      "--microbatches", "3"], "microbatches (3) must be a multiple of pp (2)"),
    (["--pp", "2", "--microbatches", "4", "--batch", "6"], "--batch 6 cannot be cut into 4 equal"),
])
def test_bad_pipeline_options_exit_2(capsys, argv, message):
    assert verify_cli.main(["--tp", "1", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--cp", "2", "--seq", "10"], "--seq 10 is not divisible by 2 * --cp 2"),
    (["--cp", "4", "--cp-variant", "ulysses", "--kv-heads", "2"], "--cp-variant ulysses gives each of the --cp 4 ranks"),
    (["--cp", "2", "--recompute", "selective"], "selective recomputation of context-parallel attention"),
])
def test_bad_context_parallel_options_exit_2(capsys, argv, message):
    assert verify_cli.main(["--tp", "1", *argv]) == 2
    assert message in capsys.readouterr().err


# The next two call the command line's main in this process (`python -m` is the test above's):
# as commands, the two took 7.7 CPU-s (this file's pytest run of them alone), in-process 3.2.
def test_cli_passes_context_parallel_ulysses(capsys):
    """The CLI path of --cp (the per-rank runs are tests/test_context_parallel_model.py's)."""
    code = verify_cli.main(["--tp", "1", "--cp", "2", "--cp-variant", "ulysses", "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "cp=2" in out and "cp_variant='ulysses'" in out
    assert out.strip().splitlines()[-1].startswith("PASS max_rel_err=")


def test_cli_passes_a_pipeline_schedule(capsys):
    code = verify_cli.main(["--tp", "1", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "4",
                            "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "schedule=zb-h1 microbatches=4 virtual=1 stage_rank=(0, 1)" in out
    assert "batch=4 " in out                                           # one sample per micro-batch
    assert out.strip().splitlines()[-1].startswith("PASS max_rel_err=")


def test_bad_config_fails_before_launching(capsys):
    assert verify_cli.main(["--tp", "2", "--hidden", "48", "--heads", "3"]) == 2
    assert "--heads 3 is not divisible by --tp 2" in capsys.readouterr().err
    assert verify_cli.main(["--tp", "2", "--sp", "--seq", "9"]) == 2
    assert "--seq 9 is not divisible" in capsys.readouterr().err
    assert verify_cli.main(["--tp", "1", "--sp"]) == 2
    assert "needs tp > 1" in capsys.readouterr().err


def test_unknown_option_is_one_line_pointing_at_help(capsys):
    assert verify_cli.main(["--tensor", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "error: unrecognized arguments: --tensor 2; see python -m minitron.verify --help\n"


def test_report_verdicts():
    ok = Report([Row(0, "loss", 1e-7, 1e-5), Row(0, "logits", 2e-5, 1e-4)])
    assert ok.passed and ok.verdict() == "PASS max_rel_err=2.00e-05"
    assert ok.table().splitlines()[-1] == ("smallest margin: tol/err = 5x (step 0 logits: 2.00e-05 "
                                           "vs tol 1.0e-04)")
    bad = Report([Row(0, "loss", 1e-7, 1e-5), Row(1, "dL/dX", float("nan"), 1e-4)])
    assert not bad.passed and bad.verdict().startswith("FAIL 1 of 2 comparisons; worst: step 1 dL/dX")
    drift = Report([Row(0, "loss", 2e-5, 1e-5), Row(0, "replicas grads", 1e-7, 0.0, "grad x differs")])
    assert drift.verdict() == "FAIL 2 of 2 comparisons; worst: step 0 replicas grads: grad x differs"


@pytest.mark.parametrize("option", ["--steps", "--batch"])
def test_steps_and_batch_must_be_positive(capsys, option):
    assert verify_cli.main([option, "0"]) == 2
    assert f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err


def test_a_wrong_shape_is_an_error_not_a_broadcast():
    # [1, n] against [n] would broadcast to an n x n difference: compare the wrong entries.
    e = {"final_norm.weight": torch.ones(4)}
    with pytest.raises(ValueError, match=r"final_norm.weight: the parallel side's shape \(1, 4\)"):
        grad_rows(0, {"final_norm.weight": torch.ones(1, 4)}, e, tol=1e-6)


def test_summary_says_pass_with_its_margin_or_fail_with_its_ratio():
    from minitron.verify.report import Report, Row
    wide = Report([Row(0, "loss", 1e-3, 4e-3), Row(0, "grad w", 1e-4, 1e-2)])
    narrow = Report([Row(0, "loss", 2e-3, 4e-3)])
    failed = Report([Row(1, "grad w", 1.9e-2, 1e-2), Row(1, "loss", 1e-3, 4e-3)])
    assert wide.summary() == "PASS, every error at most 1/3 of its tolerance: True"
    assert narrow.summary() == "PASS, every error at most 1/3 of its tolerance: False"
    assert failed.summary() == "FAIL, worst: step 1 grad w, 2x its tolerance"


# ---- a plant's target: checked against the whole model, planted where it is held --------------
@pytest.mark.parametrize("pcfg,opts,caught", [
    (ParallelConfig(pp=2), {}, "grad layers.*.mlp.fc1.weight"),        # stage 1 holds layer 1
    (ParallelConfig(ep=2), dict(n_experts=4, topk=2), "grad layers.*.mlp.experts.fc1.weight"),
])
def test_grad_plant_reaches_a_stage_or_experts_that_hold_its_target(pcfg, opts, caught):
    """A pipeline rank that does not hold the target plants nothing (it used to stop the run
    with "no parameter named"); an MoE model's MLP is its experts, the default target there."""
    report = verify.verify(pcfg, ModelConfig(**{**SMALL, **opts}), steps=1, plant="grad",
                           schedule="1f1b" if pcfg.pp > 1 else None,
                           microbatches=2 if pcfg.pp > 1 else None)
    assert [r.quantity for r in report.failures] == [caught], report.table()


def test_a_plant_target_no_parameter_has_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"plant grad: no parameter named \*nonsense; one that exists: "):
        verify.verify(ParallelConfig(tp=2), ModelConfig(**SMALL), plant="grad:nonsense")
