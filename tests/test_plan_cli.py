"""python -m minitron.estimate plan on the presets and the issue's flags; bad flags; the memory
estimator's experts under ep; the closed-form schedule peaks the planner uses, against the
simulation."""
import dataclasses
import subprocess
import sys

import pytest

from minitron.estimate import cli, plan_cli
from minitron.estimate.memory import Setup, _schedule_peak, closed_form_peak, estimate, rank_params_split
from minitron.config import ModelConfig
from minitron.model.convert import reference_shapes


@pytest.mark.parametrize("argv", [["--model", "gpt2-small", "--gpus", "8", "--gpu", "h200"],
                                  ["--model", "gpt3-175b", "--gpus", "64", "--gpu", "a100", "--global-batch", "64"],
                                  ["--model", "1t", "--gpus", "512", "--gpu", "h100", "--gpus-per-node", "8",
                                   "--global-batch", "512", "--seq", "2048"]])
def test_presets_print_the_best_and_why_the_others_lost(argv, capsys):
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "MFU" in out and "tokens/s" in out
    assert "why the others lost" in out and "all losers by reason" in out


def test_one_command_dispatches_to_each_estimator(capsys):
    assert cli.main([]) == 2 and cli.main(["plans"]) == 2
    assert "usage: python -m minitron.estimate {plan,memory,flops}" in capsys.readouterr().err
    assert cli.main(["flops", "--model", "1t", "--batch", "3072"]) == 0
    assert "FLOPs per iteration" in capsys.readouterr().out
    assert cli.main(["memory", "--model", "gpt2-small"]) == 0
    assert "optimizer state" in capsys.readouterr().out
    runs = [subprocess.run([sys.executable, "-m", *command, "--model", "gpt2-small", "--gpus", "8", "--top", "1"],
                           capture_output=True, text=True) for command in (["minitron.estimate", "plan"], ["minitron.plan"])]
    for run in runs:                                   # the planner under its long and its short name
        assert run.returncode == 0 and "configurations" in run.stdout, run.stderr
    assert runs[0].stdout == runs[1].stdout


def test_explain_prints_every_term_of_one_configuration(capsys):
    argv = ["--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--software", "megatron-2022",
            "--explain", "tp=8,pp=8,mb=1,recompute=full"]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    for term in ("compute", "memory-bound ops", "TP comm", "bubble", "PP send/recv"):
        assert term in out
    assert "tp8 pp8 dp1 mb1 zero0 full 1f1b" in out and "step 19.239" in out   # Korthikanti: 18.13 s measured, the model 6.1% slow


def test_a_described_gpu(capsys):
    argv = ["--model", "gpt2-medium", "--gpus", "16", "--gpu", "h100", "--peak-tflops", "500",
            "--memory-gib", "40", "--nvlink-gbs", "200", "--net-gbs", "25"]
    assert plan_cli.main(argv) == 0


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "0"], "--gpus 0: must be a positive integer, e.g. --gpus 8"),
    (["--gpu", "tpu"], "--gpu tpu: choose one of v100, a100, h100, h200, e.g. --gpu a100"),
    (["--peak-tflops", "-1"], "--peak-tflops -1: must be positive, e.g. --peak-tflops 312"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--gpus", "64", "--explain", "tp=8,pp=3"], "--explain: tp*pp*dp*cp*ep = 48 but --gpus is 64"),
    (["--gpus", "64", "--explain", "tq=8"], "--explain: unknown key 'tq'"),
    (["--gpus", "40", "--explain", "tp=8,pp=5"], "--explain tp=8,pp=5: 96 layers cannot be cut"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, says, capsys):
    assert plan_cli.main(argv) == 2
    assert says in capsys.readouterr().err


def test_experts_are_split_over_ep_and_counted_like_the_model():
    cfg = ModelConfig(hidden=64, n_layers=4, n_heads=4, vocab_size=128, seq_len=32, n_experts=4,
                      topk=2, moe_every=2)
    total = sum(shape.numel() for shape in reference_shapes(cfg).values())   # the reference GPT's
    dense, expert = rank_params_split(cfg)
    assert dense + expert == total
    dense2, expert2 = rank_params_split(cfg, ep=2)
    assert (dense2, expert2) == (dense, expert // 2)
    one, two = estimate(cfg, Setup(dp=2, zero=1, dtype="float32")), estimate(cfg, Setup(ep=2, zero=1, dtype="float32"))
    # ZeRO-1, float32 Adam (8 bytes per parameter): dense state over dp x ep = 2 ranks in both;
    # the experts' over dp: halved by ZeRO (dp=2) or held at half by each ep rank (ep=2)
    half = -(-dense // 2)
    assert one.optimizer == 8 * (half + -(-expert // 2)) and two.optimizer == 8 * (half + expert // 2)
    assert two.params == 4 * (dense + expert // 2)
    dense_cfg = dataclasses.replace(cfg, n_experts=0)
    assert estimate(cfg).activations > estimate(dense_cfg).activations   # top-2 MLP activations


@pytest.mark.parametrize("name, virtual", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2),
                                           ("interleaved", 3)])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 4), (4, 8), (3, 9)])
def test_closed_form_peaks_match_the_simulated_schedules(name, virtual, pp, m):
    assert closed_form_peak(name, pp, m, virtual) == _schedule_peak(name, pp, m, virtual)


def test_a_moe_model_is_planned_with_experts_over_ep():
    from minitron.hardware import GPUS
    from minitron.estimate.plan import plan
    from minitron.estimate.time_model import Cluster, Parallel, step_time
    cfg = ModelConfig(hidden=4096, n_layers=32, n_heads=32, vocab_size=51200, seq_len=4096,
                      tie_embeddings=False, n_experts=8, topk=2)
    cluster = Cluster(GPUS["h100"], 8)
    options = plan(cfg, 16, cluster, 64)
    fits = [o for o in options if o.time]
    assert fits and {o.par.ep for o in options} == {1, 2, 4, 8}
    assert any(o.par.ep > 1 for o in fits)      # 8 experts' weights do not fit without ep or ZeRO
    ep = step_time(cfg, Parallel(tp=2, sp=True, ep=4, dp=2), cluster, 64).terms["EP comm"]
    assert ep > 0 and step_time(cfg, Parallel(tp=2, sp=True, dp=8), cluster, 64).terms["EP comm"] == 0


@pytest.mark.parametrize("zero, per_param", [(0, 18), (1, 6 + 12 / 8)])
def test_fp32_gradients_are_megatrons_18_bytes_or_6_plus_12_over_d(zero, per_param):
    """Megatron-LM's docs (distrib_optimizer.md): bf16 params with fp32 grads take 18 bytes per
    parameter, 6 + 12/d with the distributed optimizer (ZeRO-1); bf16 grads would be 16."""
    cfg = ModelConfig(hidden=64, n_layers=2, n_heads=4, vocab_size=128, seq_len=32)
    su = Setup(dp=8, zero=zero, grad_dtype="float32")
    e, psi = estimate(cfg, su), sum(rank_params_split(cfg))
    padded = -(-psi // 8) * 8 if zero else psi
    assert (e.params + e.grads + e.optimizer) == pytest.approx(per_param * padded, rel=1e-3)
    assert e.grads == 2 * estimate(cfg, dataclasses.replace(su, grad_dtype=None)).grads
    with pytest.raises(ValueError, match="grad_dtype='fp8'"):
        estimate(cfg, dataclasses.replace(su, grad_dtype="fp8"))


LLAMA70 = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn-hidden", "28672",
           "--activation", "swiglu", "--vocab", "128256", "--gpus", "64", "--gpu", "h100"]


def test_a_llama_like_model_from_the_command_line(capsys):
    assert plan_cli.main(LLAMA70 + ["--seq", "8192", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "kv_heads=8 ffn=28672 swiglu" in out and "software megatron-core" in out
    # a shape from flags alone is not labelled a GPT-3 preset, and says whose norm and tie it has
    assert out.startswith("model from flags (the rest, e.g. norm and tie, is gpt3-175b's)")


def test_megatron_core_has_no_s_squared_bytes_and_gqa_shrinks_k_and_v():
    """Flash attention: doubling the sequence doubles a layer's activations and its memory-bound
    time (no s x s term); 8 key/value heads instead of 64 shrink the Q, K, V activations 4-fold
    (Q stays whole: (64 + 2 x 8) / (3 x 64))."""
    from minitron.estimate.memory import activation_bytes_per_layer
    from minitron.estimate.plan import setup
    from minitron.estimate.shape import MODERN
    from minitron.estimate.time_model import Cluster, Parallel, layer_seconds
    from minitron.estimate.software import SOFTWARE
    from minitron.hardware import GPUS
    cfg, par = MODERN["llama3-70b"], Parallel(tp=8, sp=True, pp=4, dp=2, recompute="none")
    mem = lambda c, s: activation_bytes_per_layer(c, setup(par, c, 64, s, "megatron-core"))
    assert mem(cfg, 16384) == 2 * mem(cfg, 8192)
    bound = lambda s: layer_seconds(cfg, par, Cluster(GPUS["h100"], 8), s, False,
                                    SOFTWARE["megatron-core"])["memory-bound ops"]
    assert bound(16384) == pytest.approx(2 * bound(8192))
    eager = lambda s: activation_bytes_per_layer(cfg, setup(par, cfg, 64, s, "megatron-2022"))
    assert eager(16384) > 3 * eager(8192)                       # the s^2 scores without flash
    from minitron.estimate.activations import layer_terms
    qkv = lambda kv: layer_terms(1, 8192, 8192, 64, 8, kv_heads=kv)["Q, K, V"]
    assert qkv(8) / qkv(64) == pytest.approx((64 + 16) / 192)


def test_model_shape_flags_are_checked_before_planning(capsys):
    assert plan_cli.main(["--model", "llama3-8b", "--kv-heads", "5"]) == 2
    assert "n_kv_heads" in capsys.readouterr().err
    assert plan_cli.main(["--model", "gpt3-175b", "--shared-experts", "1"]) == 2
    assert "--experts" in capsys.readouterr().err


def test_uneven_stages_cut_126_layers_into_16_stages_only_where_the_software_has_them():
    """Llama 3 (Dubey et al. 2024, §3.3.2) ran 126 layers on 16 stages, one layer fewer on the first
    and the last: Megatron-Core can (trim 1: 7 + 14 x 8 + 7), Megatron-LM 2022 cannot."""
    from minitron.estimate.plan import candidates
    from minitron.estimate.shape import MODERN
    from minitron.estimate.time_model import Cluster, Parallel, step_time
    from minitron.hardware import GPUS
    cfg = MODERN["llama3-405b"]
    core = {(p.pp, p.trim) for p in candidates(cfg, 8192, 2048, 8192, max_cp=1, software="megatron-core")}
    old = {(p.pp, p.trim) for p in candidates(cfg, 8192, 2048, 8192, max_cp=1, software="megatron-2022")}
    assert (16, 1) in core and not any(pp == 16 for pp, _ in old) and {pp for pp, _ in old} <= {1, 2}
    par = Parallel(tp=8, sp=True, pp=16, dp=64, trim=1, recompute="full", zero=1)
    assert par.stage_layers(cfg.n_layers) == 8
    cluster = Cluster(GPUS["h100"], 8)
    uneven = step_time(cfg, par, cluster, 2048, software="megatron-core")
    padded = step_time(dataclasses.replace(cfg, n_layers=128), dataclasses.replace(par, trim=0), cluster, 2048,
                       software="megatron-core")
    assert uneven.seconds < padded.seconds          # the head no longer sits on a full stage
    from minitron.estimate.software import SOFTWARE
    assert "no uneven pipeline stages" in SOFTWARE["megatron-2022"].refusal(par)


def test_megatron_2021_on_the_command_line_proposes_no_sp_selective_or_cp(capsys):
    argv = ["--model", "gpt3-175b", "--gpus", "384", "--global-batch", "1536", "--software", "megatron-2021",
            "--top", "50"]
    assert plan_cli.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("tp", "  tp"))]
    assert rows and not any("+sp" in r or "selective" in r or " cp" in r for r in rows)


def test_the_planners_output_states_its_measured_error(capsys):
    """Every plan ends with the time model's error against the published runs (issue 33)."""
    from minitron.estimate import published
    assert plan_cli.main(["--model", "gpt3-175b", "--gpus", "384", "--global-batch", "1536"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    every = [r for rows in published.all_rows().values() for r in rows]
    mean, worst = published.mean_worst(every)
    assert last.startswith("every figure above is a PREDICTION") and f"{100 * mean:.1f}% on average" in last
    assert f"{100 * worst:.1f}% at worst" in last and f"against {len(every)} published runs" in last


def test_flash_attention_streams_no_scores_and_runs_at_its_kernels_rate():
    """A flash core keeps the s x s scores on chip: a quarter of the HBM bandwidth leaves its time
    alone at 8K tokens (the GEMM roofline, which writes the scores out, was memory-bound there), and
    it runs at the sustained matmul rate unless the software names a kernel with a published lower
    utilization (llama3-2024: FlashAttention-2, 35% of an H100's peak, Shah et al. 2024)."""
    import dataclasses
    from minitron.estimate.devices import flash_attention_seconds, gemm_seconds
    from minitron.estimate.software import SOFTWARE
    from minitron.hardware import GPUS
    g = GPUS["h100"]
    slow = dataclasses.replace(g, hbm_bw=g.hbm_bw / 4)
    flops = 2 * 2 * 16 * 8192 * 8192 * 128 / 2                    # 16 heads, causal half
    assert flash_attention_seconds(8192, 8192, 128, g, 16) == pytest.approx(
        flash_attention_seconds(8192, 8192, 128, slow, 16))
    assert flash_attention_seconds(8192, 8192, 128, g, 16) == pytest.approx(
        flops / (g.peak_flops * g.matmul_eff * g.sustained))
    assert gemm_seconds(8192, 8192, 128, slow, 16) > 2 * gemm_seconds(8192, 8192, 128, g, 16)
    assert SOFTWARE["llama3-2024"].attention_utilization(g) == 0.35
    assert SOFTWARE["megatron-core"].attention_utilization(g) is None
    assert flash_attention_seconds(8192, 8192, 128, g, 16, 0.35) == pytest.approx(flops / (0.35 * g.peak_flops))
    from minitron.estimate.shape import MODERN
    from minitron.estimate.time_model import Cluster, Parallel, layer_seconds
    par = Parallel(tp=8, sp=True, pp=4, dp=2, recompute="none")
    compute = lambda gpu: layer_seconds(MODERN["llama3-70b"], par, Cluster(gpu, 8), 8192, False,
                                        SOFTWARE["megatron-core"])["compute"]
    assert compute(slow) < 1.02 * compute(g)        # only the thinnest GEMMs feel it; the eager core would
