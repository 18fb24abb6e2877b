"""Published training runs and the time model's prediction for each, under one rule.

The rule: every run is modelled with the software of its date (software.py: megatron-2019,
-2021, -2022), with the settings its paper or its released launch script states, and what
neither states takes the software's default. Nothing is chosen per table, and nothing is
fitted: every constant of the time model is a data sheet or a microbenchmark
(minitron/hardware.py; the matmul rate is the best burst's, times the sustained/burst ratio
measured at the power limit).

  Narayanan et al. 2021, Table 1 (heads, hidden, layers, TP, PP, GPUs, global batch ->
      achieved TFLOP/s per GPU, end to end), megatron-2021. The micro-batch sizes, the
      interleaved stages (--num-layers-per-virtual-pipeline-stage) and the DDP (torch's,
      overlapped, without a pipeline; Megatron's local one, after the backward, with one) are
      those of the paper's own script, NVIDIA/Megatron-LM examples/sc21/run_table_1.sh; full
      recomputation of every layer (--recompute-method uniform). FLOPs as the paper counts
      them (96 B s l h^2 (1 + s/6h + V/16lh), causal mask not discounted).
  Narayanan et al. 2021, §5.1 text: GPT-3 175B on 1024 A100s at batch 1536, 140 TFLOP/s per
      GPU. The text gives no split, so the planner chooses it (megatron-2021's features, full
      recomputation as its 8TP/(nX) estimate counts): the row tests the planner's choice as
      well as its time model.
  Korthikanti et al. 2022, Table 3 (configurations, micro-batch 1) and Table 5 (iteration time
      with full recomputation, and with sequence parallelism + selective recomputation),
      megatron-2022; no interleaving (the paper states none, Megatron's default is off).
  Shoeybi et al. 2019, Table 1 (configurations) and Figure 5 (weak-scaling efficiency, the
      bars' labels), megatron-2019: batch 8 per model replica, s = 1024, every layer
      checkpointed, DGX-2H V100s (16 per node); efficiency = per-GPU throughput over the 1.2B
      model's on one GPU (39 TFLOP/s, 30% of peak, §5.1).
All: s = 2048 (Shoeybi: 1024), V = 51200, tied embeddings, A100 80 GB in DGX nodes of 8 (Selene).

Out of sample (added after the model was built, not used to build it): Dubey et al. 2024, "The
Llama 3 Herd of Models", Table 4: Llama 3 405B on 8192 and 16384 H100s at 8192 tokens (TP 8,
CP 1, PP 16, DP 64 / 128, 16M tokens per batch -> BF16 MFU), with §3.3.2's pipeline: one layer fewer on the first
and the last stage, the interleaved schedule with V stages per rank, V = 8 (§3.3.2: "the first
model chunk on the first stage has only the embedding, and the last model chunk on the last stage
has only output projection and loss calculation", so a chunk holds one layer: 126 + 2 = 128
chunks on 16 ranks), asynchronous point-to-point sends, and no recomputation ("without activation
checkpointing"). Approximations the planner forces: ZeRO-1 for its FSDP-style sharding of
gradients and optimizer state, and MFU with the attention core counted without the causal
discount (the paper does not say how it counts; at 8K tokens the core is ~8% of the FLOPs). Its
131K-token row is left out: there the counting convention alone changes the MFU by a third.
Meta's stack is not Megatron: the rows run under llama3-2024 (software.py), the features the
paper names; what it does not name (TP overlapped with the GEMMs) it is taken not to have.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..hardware import GPUS
from .flops import iteration_flops
from .time_model import Cluster, Parallel, step_time

NARAYANAN_TABLE1 = [  # name, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
KORTHIKANTI_TABLE5 = [  # name, heads, hidden, layers, tp, pp, gpus, batch, seconds (full, SP+selective)
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
]
# examples/sc21/run_table_1.sh, per Table 1 row: micro-batch, interleaved stages v
# (layers / pp / --num-layers-per-virtual-pipeline-stage; 1 when the script sets none)
NARAYANAN_SCRIPT = {"1.7B": (16, 1), "3.6B": (16, 1), "7.5B": (16, 1), "18.4B": (8, 1), "39.1B": (4, 1),
                    "76.1B": (2, 3), "145.6B": (2, 2), "310.1B": (1, 2), "529.6B": (1, 3), "1008B": (1, 1)}
DUBEY_V = 8        # §3.3.2: one layer per model chunk (module docstring)
DUBEY_TABLE4 = [  # GPUs, TP, CP, PP, DP, sequence, sequences per DP rank, BF16 MFU
    (8192, 8, 1, 16, 64, 8192, 32, 0.43), (16384, 8, 1, 16, 128, 8192, 16, 0.41),
]
NARAYANAN_TABLE2_175B_GPUS = (384, 768, 1536)   # Table 2: 175B at t8 x p12, batch 1536 (not held: its
#                                                 figures compare with ZeRO-3, not a split of ours)
NARAYANAN_TEXT = ("175B on 1024 GPUs", 96, 12288, 96, 1024, 1536, 140)   # §5.1, no split given
SHOEYBI_WEAK = [  # name, heads, hidden, layers, model-parallel GPUs, efficiency on those, on 64x as many
    ("1.2B", 16, 1536, 40, 1, 1.00, 0.96), ("2.5B", 20, 1920, 54, 2, 0.95, 0.83),
    ("4.2B", 24, 2304, 64, 4, 0.82, 0.79), ("8.3B", 32, 3072, 72, 8, 0.77, 0.74),
]
SHOEYBI_DP = 64          # model + data parallel: 64 replicas


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    measured: float
    predicted: float
    unit: str

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def gpt(heads: int, hidden: int, layers: int, seq: int = 2048) -> ModelConfig:
    return ModelConfig(hidden=hidden, n_layers=layers, n_heads=heads, vocab_size=51200,
                       seq_len=seq, tie_embeddings=True)


def narayanan(gpus: dict = GPUS) -> list[Row]:
    cluster, rows = Cluster(gpus["a100"], 8), []
    for name, a, h, layers, tp, pp, n, batch, tflops in NARAYANAN_TABLE1:
        mb, v = NARAYANAN_SCRIPT[name]
        par = Parallel(tp=tp, pp=pp, dp=n // (tp * pp), micro_batch=mb, virtual=v, recompute="full",
                       zero=0, schedule="interleaved" if v > 1 else "1f1b")
        bd = step_time(gpt(a, h, layers), par, cluster, batch, software="megatron-2021")
        rows.append(Row(name, tflops, bd.flops_per_gpu / 1e12, "TFLOP/s per GPU"))
    return rows


def narayanan_text(gpus: dict = GPUS) -> Row:
    """§5.1's 175B on 1024 GPUs: the planner's own best split, its predicted step in the paper's
    units (its FLOPs with full recomputation, 8TP/(nX) of §5.1, over time and GPUs)."""
    from .plan import plan
    name, a, h, layers, n, batch, tflops = NARAYANAN_TEXT
    cfg = gpt(a, h, layers)
    best = plan(cfg, n, Cluster(gpus["a100"], 8), batch, software="megatron-2021",
                recomputes=("full",))[0]        # §5.1's 8TP/(nX): recomputation, as in Table 1
    paper_flops = iteration_flops(cfg, batch, cfg.seq_len, "full")
    return Row(f"{name} ({best.par.label()})", tflops, paper_flops / best.time.seconds / n / 1e12,
               "TFLOP/s per GPU")


def korthikanti(gpus: dict = GPUS) -> list[Row]:
    cluster, rows = Cluster(gpus["a100"], 8), []
    for name, a, h, layers, tp, pp, n, batch, full, selective in KORTHIKANTI_TABLE5:
        for recompute, sp, seconds in (("full", False, full), ("selective", True, selective)):
            par = Parallel(tp=tp, pp=pp, dp=n // (tp * pp), recompute=recompute, sp=sp, zero=0)
            bd = step_time(gpt(a, h, layers), par, cluster, batch, software="megatron-2022")
            label = f"{name} {'full' if recompute == 'full' else 'SP+selective'}"
            rows.append(Row(label, seconds, bd.seconds, "s per iteration"))
    return rows


def shoeybi(gpus: dict = GPUS) -> list[Row]:
    """Weak-scaling efficiency: per-GPU FLOP/s of each run over the 1.2B model's on one GPU."""
    cluster = Cluster(gpus["v100"], 16)

    def per_gpu(a, h, layers, tp, dp=1):
        par = Parallel(tp=tp, dp=dp, micro_batch=8, recompute="full", zero=0)
        return step_time(gpt(a, h, layers, seq=1024), par, cluster, 8 * dp,
                         software="megatron-2019").flops_per_gpu
    base = per_gpu(*SHOEYBI_WEAK[0][1:5])
    rows = []
    for name, a, h, layers, tp, alone, replicated in SHOEYBI_WEAK:
        for dp, measured in ((1, alone), (SHOEYBI_DP, replicated)):
            if dp == 1 and tp == 1:
                continue                       # the baseline itself: 100% by definition
            rows.append(Row(f"{name} on {tp * dp} GPU{'s' * (tp * dp > 1)}", measured,
                            per_gpu(a, h, layers, tp, dp) / base, "weak-scaling efficiency"))
    return rows


def dubey(gpus: dict = GPUS) -> list[Row]:
    """Llama 3 405B at Table 4's splits (out of sample: see the module docstring)."""
    from .shape import MODERN
    cfg, cluster, rows = MODERN["llama3-405b"], Cluster(gpus["h100"], 8), []
    for n, tp, cp, pp, dp, seq, per_dp, mfu in DUBEY_TABLE4:
        par = Parallel(tp=tp, sp=True, pp=pp, cp=cp, dp=dp, trim=1, recompute="none", zero=1,
                       virtual=DUBEY_V, schedule="interleaved")
        bd = step_time(cfg, par, cluster, per_dp * dp, seq, software="llama3-2024")
        rows.append(Row(f"405B on {n} H100s", mfu, bd.mfu, "BF16 MFU"))
    return rows


def all_rows(gpus: dict = GPUS) -> dict[str, list[Row]]:
    """Every published point the planner is held to, by source."""
    return {"Narayanan et al. 2021, Table 1 (megatron-2021)": narayanan(gpus),
            "Narayanan et al. 2021, §5.1 text (megatron-2021, the planner's split)": [narayanan_text(gpus)],
            "Korthikanti et al. 2022, Table 5 (megatron-2022)": korthikanti(gpus),
            "Shoeybi et al. 2019, Figure 5 (megatron-2019)": shoeybi(gpus),
            "Dubey et al. 2024, Table 4, out of sample (llama3-2024)": dubey(gpus)}


EFFICIENCIES = ("matmul_eff", "hbm_eff", "nvlink_eff", "net_eff")


def sensitivity(step: float = 0.10) -> list[tuple[str, float, float, float]]:
    """(constant, mean |error| at -step, at the constant's value, at +step) over every point:
    each hardware efficiency of every GPU moved by the same fraction, the others held."""
    every = lambda tables: mean_worst([r for rows in tables.values() for r in rows])[0]
    base, out = every(all_rows()), []
    for field in EFFICIENCIES:
        moved = [every(all_rows({k: dataclasses.replace(g, **{field: getattr(g, field) * f})
                                 for k, g in GPUS.items()})) for f in (1 - step, 1 + step)]
        out.append((field, moved[0], base, moved[1]))
    return out


def sensitivity_table(step: float = 0.10) -> str:
    lines = [f"mean |error| over every point when one efficiency moves by {step:.0%}:",
             f"{'constant':<12}{'-' + format(step, '.0%'):>8}{'as is':>8}{'+' + format(step, '.0%'):>8}"]
    lines += [f"{name:<12}{100 * lo:7.1f}%{100 * mid:7.1f}%{100 * hi:7.1f}%"
              for name, lo, mid, hi in sensitivity(step)]
    return "\n".join(lines)


def mean_worst(rows: list[Row]) -> tuple[float, float]:
    errors = [abs(r.error) for r in rows]
    return sum(errors) / len(errors), max(errors)


def summary(rows: list[Row]) -> str:
    lines = [f"{r.name:<40} measured {r.measured:8.4g}  predicted {r.predicted:8.4g}  "
             f"error {100 * r.error:+6.1f}%" for r in rows]
    mean, worst = mean_worst(rows)
    lines.append(f"{rows[0].unit}: mean |error| {100 * mean:.1f}%, worst {100 * worst:.1f}%")
    return "\n".join(lines)


def accuracy_line() -> str:
    """One line for the planner's output: how far its time model is from every published run."""
    tables = all_rows()
    every = [r for rows in tables.values() for r in rows]
    mean, worst = mean_worst(every)
    far = max(every, key=lambda r: abs(r.error))
    return (f"every figure above is a PREDICTION; against {len(every)} published runs the time model "
            f"is off by {100 * mean:.1f}% on average, {100 * worst:.1f}% at worst ({far.name.split(' (')[0]}); "
            "python -c 'from minitron.estimate import published; print(published.report())' lists them")


def report() -> str:
    """Every table, then the mean and worst over all points (what the goal is stated on)."""
    tables, out = all_rows(), []
    for source, rows in tables.items():
        out += [source, summary(rows), ""]
    every = [r for rows in tables.values() for r in rows]
    mean, worst = mean_worst(every)
    out.append(f"all {len(every)} points: mean |error| {100 * mean:.1f}%, worst {100 * worst:.1f}%")
    return "\n".join(out)
