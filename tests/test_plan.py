"""The planner's time model against every published run it is held to, under one rule, and the
planner's choices.

The rule (minitron/estimate/software.py, published.py): each paper is modelled with the software
of its date and the settings its text or launch script states; nothing is fitted or chosen per
table. `pytest -s tests/test_plan.py` prints every row's error and each table's mean and worst.
The goal is a mean |error| <= 5% and a worst <= 10% over all of them; where the model does not
reach it, the bound below is what it reaches (recorded, so a change that makes it worse fails),
and test_the_goal_over_every_point says the goal is not met until it is.
"""
import dataclasses

import pytest

from minitron.estimate import published
from minitron.hardware import GPUS
from minitron.estimate.plan import evaluate, plan
from minitron.estimate.software import SOFTWARE
from minitron.estimate.time_model import Cluster, Parallel, gemm_seconds, step_time

# what the model reaches today, per table (mean, worst |error|), rounded up to the next percent
REACHED = {"Narayanan et al. 2021, Table 1 (megatron-2021)": (0.06, 0.12),
           "Narayanan et al. 2021, §5.1 text (megatron-2021, the planner's split)": (0.14, 0.14),
           "Korthikanti et al. 2022, Table 5 (megatron-2022)": (0.05, 0.08),
           "Shoeybi et al. 2019, Figure 5 (megatron-2019)": (0.05, 0.14),
           "Dubey et al. 2024, Table 4, out of sample (llama3-2024)": (0.12, 0.14)}


@pytest.fixture(scope="module")
def tables():
    return published.all_rows()


def test_every_published_point_is_held_and_printed(tables, capsys):
    with capsys.disabled():
        print("\n" + published.report() + "\n\n" + published.sensitivity_table())
    assert [len(rows) for rows in tables.values()] == [10, 1, 8, 7, 2]
    for source, rows in tables.items():
        mean, worst = published.mean_worst(rows)
        bound_mean, bound_worst = REACHED[source]
        assert mean <= bound_mean and worst <= bound_worst, f"{source}: worse than recorded"


@pytest.mark.xfail(strict=True, reason="not met: mean 5.6%, worst 13.7%; the worst points are the "
                   "planner's own split for §5.1's figure (13.7% fast; every split near its best is 10-14% "
                   "fast), Shoeybi's 8.3B on 512 GPUs (13.6% low) and 2.5B on 128 (10.2% high): the 2019 code "
                   "reduces after the backward, and the figure's data-parallel losses (4%, 12.6%, 3.7%, 3.9% "
                   "at 1.2B, 2.5B, 4.2B, 8.3B) follow no bytes-over-bandwidth model, Llama 3 on 8192 GPUs "
                   "(13.5% fast on Meta's stack: no term the paper names is left out) and Table 1's 1.7B "
                   "(11.7% fast); lesson 13 says why")
def test_the_goal_over_every_point(tables):
    every = [r for rows in tables.values() for r in rows]
    mean, worst = published.mean_worst(every)
    assert mean <= 0.05 and worst <= 0.10


def test_each_row_uses_only_its_softwares_features():
    """The one rule holds in the rows themselves: no 2021 row has SP or selective recomputation,
    no 2019 row a pipeline, and every row's software has what the row uses."""
    for name, *_ in published.NARAYANAN_TABLE1:
        mb, v = published.NARAYANAN_SCRIPT[name]
        par = Parallel(virtual=v, micro_batch=mb, recompute="full", zero=0,
                       schedule="interleaved" if v > 1 else "1f1b")
        assert SOFTWARE["megatron-2021"].refusal(par) == ""
    assert SOFTWARE["megatron-2021"].refusal(Parallel(tp=8, sp=True, recompute="selective", zero=0))
    assert SOFTWARE["megatron-2019"].refusal(Parallel(pp=2, zero=0))


def test_2021s_dp_reduction_hides_behind_the_backward_only_without_a_pipeline():
    """examples/sc21/run_table_1.sh: DDP=torch (buckets reduced during the backward) for the rows
    without a pipeline, DDP=local (after the backward) for those with one; 2019 always after."""
    cfg, cluster = published.gpt(24, 2304, 24), Cluster(GPUS["a100"], 8)
    dp = lambda sw, pp: step_time(cfg, Parallel(pp=pp, dp=32, micro_batch=16, recompute="full", zero=0),
                                  cluster, 512, software=sw).terms["DP comm"]
    assert dp("megatron-2021", 1) < dp("megatron-2019", 1) / 5      # hidden but its last bucket
    assert dp("megatron-2021", 2) == pytest.approx(dp("megatron-2019", 2))


@pytest.mark.parametrize("sp", [False, True])
def test_2022s_backward_tp_collectives_run_beside_the_column_linears_gemms(sp):
    """megatron-2022's LinearWithGradAccumulationAndAsyncCommunication: inside a node the
    backward's collectives hide behind QKV's and fc1's backward GEMMs, so a layer's exposed TP
    time is the forward's 2 (of 2021's 4) all-reduces, plus with SP the all-gathers that are the
    reduce-scatters' backward (one all-reduce's bytes). Fails if the 2022 backward is synchronous."""
    from minitron.estimate.time_model import layer_seconds
    from minitron.estimate.devices import link
    from minitron.hardware import ring_seconds
    cfg, cluster = published.gpt(96, 12288, 96), Cluster(GPUS["a100"], 8)
    par = Parallel(tp=8, pp=8, sp=sp, recompute="selective" if sp else "none", zero=0)
    one = ring_seconds(2 * 2048 * 12288, 8, link("tp", par, cluster))
    tp = lambda sw: layer_seconds(cfg, par, cluster, 2048, False, SOFTWARE[sw])["TP comm"]
    assert tp("megatron-2022") == pytest.approx((3 if sp else 2) * one)
    if not sp:
        assert tp("megatron-2021") == pytest.approx(4 * one)


def test_korthikanti_sp_and_selective_are_faster_by_about_the_papers_share(tables):
    rows = tables["Korthikanti et al. 2022, Table 5 (megatron-2022)"]
    for full, selective in zip(rows[::2], rows[1::2]):   # the paper: 1.29x to 1.32x
        assert 1.2 < full.predicted / selective.predicted < 1.45


def test_megatron_2019_weak_scaling_is_efficiency_not_peak(tables):
    rows = tables["Shoeybi et al. 2019, Figure 5 (megatron-2019)"]
    alone = [r.predicted for r in rows if r.name.endswith(("on 2 GPUs", "on 4 GPUs", "on 8 GPUs"))]
    assert alone == sorted(alone, reverse=True) and alone[0] < 1   # each doubling of tp loses more
    # the denominator is the 1.2B model's own throughput on one GPU, not the V100's peak
    cfg = published.gpt(16, 1536, 40, seq=1024)
    one = step_time(cfg, Parallel(micro_batch=8, recompute="full", zero=0), Cluster(GPUS["v100"], 16), 8,
                    software="megatron-2019")
    assert one.flops_per_gpu / GPUS["v100"].peak_flops < 0.6 < rows[0].predicted


@pytest.mark.parametrize("software", ["megatron-2019", "megatron-2021"])
def test_the_planner_never_proposes_a_feature_outside_its_software(software):
    cfg, cluster = published.gpt(96, 12288, 96), Cluster(GPUS["a100"], 8)
    options = plan(cfg, 384, cluster, 1536, software=software)
    assert options and all(SOFTWARE[software].refusal(o.par) == "" for o in options)
    assert not any(o.par.sp or o.par.cp > 1 or o.par.recompute == "selective" or o.par.zero
                   for o in options)
    if software == "megatron-2019":
        assert {o.par.pp for o in options} == {1}
    with pytest.raises(ValueError, match="no sequence parallelism"):
        evaluate(cfg, Parallel(tp=8, pp=8, dp=6, sp=True, zero=0), cluster, 1536, 2048, software)


def test_the_planners_choices_follow_narayanans_takeaways():
    """In the paper's space (megatron-2021, full recomputation) for every Table 1 model, the
    planner's best split keeps TP inside a node (§5.4, Takeaway #1), uses a model-parallel size
    t x p no larger than the paper's, leaving the rest to data parallelism (Takeaway #2), needs
    no pipeline for the small models and a deep one for the largest. Any of these can fail: the
    best is a search, not the paper's configuration handed back."""
    cluster, pps = Cluster(GPUS["a100"], 8), []
    for name, a, h, layers, tp, pp, gpus, batch, _ in published.NARAYANAN_TABLE1:
        best = plan(published.gpt(a, h, layers), gpus, cluster, batch, software="megatron-2021",
                    recomputes=("full",))[0]
        assert best.time is not None and best.par.tp <= 8, f"{name}: TP across nodes"
        assert best.par.tp * best.par.pp <= tp * pp, f"{name}: {best.par.label()}"
        pps.append(best.par.pp)
    assert pps[:3] == [1, 1, 1] and pps[-1] >= 32, pps


def test_a_last_partial_wave_costs_a_whole_wave():
    g = GPUS["a100"]
    one_wave = gemm_seconds(128 * 9, 128 * 12, 16384, g)         # 9 x 12 = 108 tiles on 108 SMs
    two_waves = gemm_seconds(128 * 9, 128 * 12 + 1, 16384, g)    # 117 tiles: a second, idle wave
    assert two_waves / one_wave > 1.8
    two_full = gemm_seconds(128 * 9, 128 * 24, 16384, g)          # 216 tiles: twice the work
    assert two_full == pytest.approx(2 * one_wave) and two_full / two_waves < 1.1


def test_terms_follow_the_grid():
    cfg, cluster = published.gpt(96, 12288, 96), Cluster(GPUS["a100"], 8)
    t = lambda **kw: step_time(cfg, Parallel(recompute="full", **kw), cluster, 64, software="megatron-2022").terms
    assert t(tp=8, pp=8)["bubble"] == pytest.approx(2 * t(tp=8, pp=8, virtual=2, schedule="interleaved")["bubble"])
    # pp4 gives each rank twice pp8's layers: across two nodes each layer's TP costs more (the NICs)
    assert t(tp=8, pp=8)["TP comm"] < t(tp=16, pp=4)["TP comm"] / 2
    assert t(tp=1, pp=8, dp=8)["TP comm"] == 0 and t(tp=8, pp=8)["DP comm"] == 0


def test_nothing_fits_gives_the_smallest_and_why():
    options = plan(published.gpt(96, 12288, 96), 8, Cluster(GPUS["a100"], 8), 8)
    assert all(o.time is None for o in options) and "does not fit" in options[0].reason


def test_a_training_gemm_runs_at_the_sustained_not_the_burst_rate():
    """hardware.GPU.sustained (MSMF over MAMF, Bekman's all-8-GPUs measurement): a GEMM of one
    whole wave runs at peak x burst efficiency x sustained, not at the burst benchmark's rate."""
    import dataclasses
    g = GPUS["a100"]
    m, n, k = 128 * 9, 128 * 12, 16384                          # 108 tiles on 108 SMs
    assert gemm_seconds(m, n, k, g) == pytest.approx(2 * m * n * k / (g.peak_flops * g.matmul_eff * 0.848), rel=1e-3)
    burst = dataclasses.replace(g, sustained=1.0)
    assert gemm_seconds(m, n, k, g) / gemm_seconds(m, n, k, burst) == pytest.approx(1 / g.sustained)
    with pytest.raises(ValueError, match="sustained"):
        dataclasses.replace(g, sustained=1.2)


@pytest.mark.parametrize("software,sp", [("megatron-2021", False), ("megatron-2022", True),
                                         ("megatron-core", False)])
def test_a_pipeline_message_is_what_the_software_sends(software, sp):
    """Megatron 2021-22 without SP scatters a stage's output over tp and all-gathers it on
    arrival (p2p_communication.py, gather_split_1d_tensor); under SP it is split already, no
    gather; megatron-core without SP sends it whole. Fails if the gather or the split is dropped."""
    from minitron.estimate.devices import link
    from minitron.hardware import ring_seconds
    cfg, cluster = published.gpt(96, 12288, 96), Cluster(GPUS["a100"], 8)
    par = Parallel(tp=8, pp=8, sp=sp, recompute="selective" if sp else "full", zero=0)
    bd = step_time(cfg, par, cluster, 64, software=software)
    full = 2 * 2048 * 12288
    bw, lat = link("pp", par, cluster, point_to_point=True)
    one = {"megatron-2021": full / 8 / bw + lat + ring_seconds(full, 8, link("tp", par, cluster), 1),
           "megatron-2022": full / 8 / bw + lat, "megatron-core": full / bw + lat}[software]
    assert bd.terms["PP send/recv"] == pytest.approx(64 * 2 * one)


@pytest.mark.parametrize("software,per_param", [("megatron-2021", 52), ("megatron-2022", 46)])
def test_the_optimizer_step_streams_megatrons_bytes(software, per_param):
    """Megatron's step(): [16-bit grads to fp32 main grads: 6], unscale and inf check 8, the norm 4,
    Adam 28, the fp32 parameters copied back to 16 bits 6, per parameter at HBM speed."""
    from minitron.estimate.time_model import dense_params_per_rank
    cfg, g = published.gpt(24, 2304, 24), GPUS["a100"]
    par = Parallel(dp=32, micro_batch=16, recompute="full", zero=0)
    bd = step_time(cfg, par, Cluster(g, 8), 512, software=software)
    assert bd.terms["optimizer"] == pytest.approx(per_param * dense_params_per_rank(cfg, par) / (g.hbm_bw * g.hbm_eff))


def test_megatron_2019_runs_each_elementwise_step_as_its_own_kernel():
    """The 2019 code (NVIDIA/Megatron-LM a0368ddf47, mpu/transformer.py) scales, masks, softmaxes
    and drops the scores in five kernels (21 bytes per score element against the fused 9) and adds
    bias, dropout and residual apart (15 bytes per element against 7), and its backward runs the
    scaling's and the mask product's backward too (19 bytes per score element against 11): a
    layer's memory-bound time is exactly that many more bytes at HBM speed (the context's copy
    back, 4 E/t, every Megatron makes: test_megatrons_core_attention_copies_its_context_back).
    Fails if megatron-2019 is given fused kernels (planted: dataclasses.replace)."""
    import dataclasses
    from minitron.estimate.time_model import layer_seconds
    cfg, cluster = published.gpt(32, 3072, 72, seq=1024), Cluster(GPUS["v100"], 16)
    par, g = Parallel(tp=8, micro_batch=8, recompute="full", zero=0), GPUS["v100"]
    old = SOFTWARE["megatron-2019"]
    fused = dataclasses.replace(old, fused_kernels=True)
    extra = layer_seconds(cfg, par, cluster, 1024, False, old)["memory-bound ops"] - \
        layer_seconds(cfg, par, cluster, 1024, False, fused)["memory-bound ops"]
    E, S = 8 * 1024 * 3072, 8 * (32 // 8) * 1024 * 1024
    rest, core_forward, core_backward = 2 * (15 - 7) * E, (21 - 9) * S, (19 - 11) * S
    assert extra == pytest.approx((4 * rest + 2 * core_forward + core_backward) / (g.hbm_bw * g.hbm_eff))
    assert all(s.fused_kernels for name, s in SOFTWARE.items() if name != "megatron-2019")


def test_llama3s_pipeline_interleaves_beside_its_uneven_stages():
    """Dubey et al. 2024 §3.3.2: 126 layers on 16 ranks, one fewer on the first and last, V = 8
    chunks per rank, bubble (PP-1)/(V M). megatron-core accepts it, its bubble is 1/8 of the
    uneven 1F1B's, and each send hides behind half a chunk's forward and backward
    (overlap_p2p_comm). Fails if the refusal returns or the sends are charged in full."""
    from minitron.estimate.shape import MODERN
    from minitron.estimate.devices import link
    cfg, cluster = MODERN["llama3-405b"], Cluster(GPUS["h100"], 8)
    flat = Parallel(tp=8, sp=True, pp=16, dp=128, trim=1, recompute="none", zero=1)
    inter = dataclasses.replace(flat, virtual=8, schedule="interleaved")
    assert SOFTWARE["megatron-core"].refusal(inter) == ""
    a, b = (step_time(cfg, p, cluster, 16 * 128, 8192, software="megatron-core") for p in (flat, inter))
    assert b.terms["bubble"] == pytest.approx(a.terms["bubble"] / 8)
    bw, lat = link("pp", inter, cluster, point_to_point=True)
    send = 2 * 8192 * cfg.hidden / 8 / bw + lat
    stage = a.terms["bubble"] / 15                           # one rank's fwd + bwd of one micro-batch
    assert b.terms["PP send/recv"] == pytest.approx(16 * 8 * 2 * max(0.0, send - stage / 16))
    assert a.terms["PP send/recv"] == pytest.approx(16 * 2 * send)   # 1F1B: not overlapped


def test_llama3s_stack_runs_tp_synchronously_and_reduces_in_fp32():
    """llama3-2024 is what Dubey et al. 2024 §3.3 name: no TP overlap named, so a layer's exposed TP
    time is all four SP collectives' (an all-reduce's bytes each pair), where megatron-core hides
    most behind the GEMMs; FSDP's gradients reduce-scattered in fp32, and accumulated in fp32 by
    adding each micro-batch's 16-bit gradient (10 bytes per parameter at HBM speed), no fused
    wgrad GEMM named. Fails if the setting is given TP overlap or accumulation fusion (planted)."""
    from minitron.estimate.shape import MODERN
    from minitron.estimate.devices import link
    from minitron.estimate.time_model import layer_seconds
    from minitron.hardware import ring_seconds
    cfg, cluster = MODERN["llama3-405b"], Cluster(GPUS["h100"], 8)
    par = Parallel(tp=8, sp=True, pp=16, dp=64, trim=1, virtual=8, schedule="interleaved",
                   recompute="none", zero=1)
    assert SOFTWARE["llama3-2024"].refusal(par) == "" and SOFTWARE["llama3-2024"].grad_reduce_bytes == 4
    one = ring_seconds(2 * 8192 * cfg.hidden, 8, link("tp", par, cluster))
    tp = lambda sw: layer_seconds(cfg, par, cluster, 8192, False, SOFTWARE[sw])["TP comm"]
    assert tp("llama3-2024") == pytest.approx(4 * one)
    assert tp("megatron-core") < 2 * one
    from minitron.estimate.time_model import dense_params_per_rank
    g = cluster.gpu
    bd = step_time(cfg, par, cluster, 32 * 64, 8192, software="llama3-2024")
    assert bd.terms["grad accumulation"] == pytest.approx(
        32 * 10 * dense_params_per_rank(cfg, par) / (g.hbm_bw * g.hbm_eff))


@pytest.mark.parametrize("software", ["llama3-2024", "megatron-core"])
def test_zero1_gathers_16_bit_parameters_after_reducing_fp32_gradients(software):
    """Under ZeRO-1 (Megatron's distributed optimizer; Llama 3's FSDP) the gradients are
    reduce-scattered at their bytes (4: both reduce in fp32) and the updated parameters are
    all-gathered in 16 bits, not as a 4-byte all-reduce; ZeRO-0 stays one all-reduce of the fp32
    gradients. Fails if the all-gather is charged at the gradients' bytes."""
    from minitron.estimate.devices import link
    from minitron.estimate.optimizer_time import dp_seconds, params_per_rank
    from minitron.hardware import ring_seconds
    from minitron.estimate.shape import MODERN
    cfg, cluster, sw = MODERN["llama3-405b"], Cluster(GPUS["h100"], 8), SOFTWARE[software]
    base = cluster.gpu.collective_latency
    for zero in (0, 1):
        par = Parallel(tp=8, sp=True, pp=16, dp=64, recompute="none", zero=zero)
        psi, bw = params_per_rank(cfg, par)[0], link("dp", par, cluster)
        want = (ring_seconds(4 * psi, 64, bw, 1, base) + ring_seconds(2 * psi, 64, bw, 1, base) if zero
                else ring_seconds(4 * psi, 64, bw, base=base))
        got = dp_seconds(cfg, par, cluster, sw, 1, 0.0)          # nothing to hide behind: all of it
        assert got == pytest.approx(want + want / 25)


@pytest.mark.parametrize("software", ["megatron-2021", "megatron-2022"])
def test_megatrons_core_attention_copies_its_context_back(software):
    """Megatron's core attention permutes its context [b, a/t, s, d] back to [s, b, h/t] with
    .contiguous() (megatron/model/transformer.py, 2019 to 2022): 4 E/t bytes per forward beside the
    fused kernels' 22 R + 4 E f/(h t), four passes under full recomputation (forward, the
    recomputed forward, the backward's two), and the core's 9 S twice forward and 11 S backward
    (dropout's 5, softmax's 6). Fails if the copy is charged to 2019's unfused kernels only, or
    the core's backward is charged twice its forward."""
    from minitron.estimate.time_model import layer_seconds
    cfg, cluster, t = published.gpt(24, 2304, 24), Cluster(GPUS["a100"], 8), 2
    par = Parallel(tp=t, micro_batch=16, recompute="full", zero=0)
    E, S = 16 * 2048 * 2304, 16 * (24 // t) * 2048 ** 2
    rest = 22 * E + 4 * E * 4 / t + 4 * E / t
    g = cluster.gpu
    got = layer_seconds(cfg, par, cluster, 2048, False, SOFTWARE[software])["memory-bound ops"]
    assert got == pytest.approx((4 * rest + 2 * 9 * S + 11 * S) / (g.hbm_bw * g.hbm_eff))


def test_shoeybis_4b_and_8b_points_outrun_the_dgx2hs_nics():
    """Why no bandwidth model gives Shoeybi et al.'s 64-way points (Figure 5), with the 2019 code's
    all-reduce after the backward: the time each point lost to data parallelism (its step at 64x
    less its step alone, from the figure's efficiencies and §5.1's 39 TFLOP/s baseline) against the
    fewest bytes each DGX-2H must send for it, 2(k-1)/k of every data-parallel group's fp16
    gradients over k nodes (any all-reduce algorithm; tp groups per node run at once). The 1.2B and
    2.5B points need 39 and 25 GB/s, less than the node's 8 x 100 Gb/s (§5: 100 GB/s per server),
    the 4.2B and 8.3B points 181 and 334 GB/s, more than it can carry at all: they are not
    reachable with that all-reduce exposed."""
    from minitron.estimate.flops import iteration_flops
    from minitron.estimate.optimizer_time import params_per_rank
    needed = {}
    for name, a, h, layers, tp, alone, replicated in published.SHOEYBI_WEAK:
        cfg = published.gpt(a, h, layers, seq=1024)
        per_gpu = iteration_flops(cfg, 8, 1024, "full") / tp / 39e12
        lost = per_gpu / replicated - per_gpu / alone
        nodes = tp * published.SHOEYBI_DP // 16
        grads = 2 * params_per_rank(cfg, Parallel(tp=tp, dp=published.SHOEYBI_DP, zero=0))[0]
        needed[name] = tp * 2 * (nodes - 1) / nodes * grads / lost        # B/s out of each node
    nics = 8 * 100e9 / 8
    assert needed["1.2B"] < nics and needed["2.5B"] < nics
    assert needed["4.2B"] > 1.5 * nics and needed["8.3B"] > 3 * nics
