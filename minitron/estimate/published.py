"""Published training runs and the time model's prediction for each one's own configuration.

Nothing here is fitted: every constant of the time model is a hardware specification or a
microbenchmark (minitron/hardware.py). What the papers do not state is assumed, the same way for every
row:
  - micro-batch size 1 (Megatron's default) and the non-interleaved 1F1B schedule (v = 1);
  - FLOPs as the papers count them: Narayanan et al.'s formula with full recomputation
    (96 B s l h^2 (1 + s/6h + V/16lh): every matmul, logits included, causal mask not
    discounted); their "achieved TFLOP/s per GPU" is that over time and GPUs;
  - the software of the paper's time (time_model.SOFTWARE): Narayanan et al. 2021 without
    gradient-accumulation fusion and with the data-parallel all-reduce after the backward;
    Korthikanti et al. 2022 with the fusion;
  - s = 2048, V = 51200, tied embeddings, A100 80 GB in DGX nodes of 8 (Selene).

Narayanan et al. 2021, Table 1 (heads, hidden, layers, TP, PP, GPUs, global batch -> measured
TFLOP/s per GPU, end to end: data loading, optimizer and logging included).
Korthikanti et al. 2022, Table 3 (configurations, micro-batch 1) and Table 5 (iteration time with
full recomputation, and with sequence parallelism + selective recomputation).
Shoeybi et al. 2019 (Megatron-LM), Table 1 / Figure 1: weak scaling on DGX-2H V100s (16 per node),
batch 8 per model replica, s = 1024, V = 51200, activation checkpointing after every layer;
efficiency = per-GPU throughput over the 1.2B model's on one GPU (39 TFLOP/s, 30% of peak):
8.3B on 8 GPUs (model parallel) 77%, x 64 data parallel on 512 GPUs 74%.

The bar: Calculon (Isaev et al. 2023) on Table 1 with its stock A100 description is 8-12% off on
average, mostly too optimistic (up to +21% on the 1.7B row).
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..hardware import GPUS
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
SHOEYBI_WEAK = [  # name, heads, hidden, layers, model-parallel GPUs, measured efficiency (or None)
    ("1.2B", 16, 1536, 40, 1, None), ("2.5B", 20, 1920, 54, 2, None),
    ("4.2B", 24, 2304, 64, 4, None), ("8.3B", 32, 3072, 72, 8, 0.77),
]
SHOEYBI_DP = 64, 0.74      # 64-way data parallelism of the 8.3B model on 512 GPUs, measured


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


def narayanan() -> list[Row]:
    cluster, rows = Cluster(GPUS["a100"], 8), []
    for name, a, h, layers, tp, pp, n, batch, tflops in NARAYANAN_TABLE1:
        par = Parallel(tp=tp, pp=pp, dp=n // (tp * pp), recompute="full", zero=0)
        bd = step_time(gpt(a, h, layers), par, cluster, batch, software="megatron-2021")
        rows.append(Row(name, tflops, bd.flops_per_gpu / 1e12, "TFLOP/s per GPU"))
    return rows


def korthikanti() -> list[Row]:
    cluster, rows = Cluster(GPUS["a100"], 8), []
    for name, a, h, layers, tp, pp, n, batch, full, selective in KORTHIKANTI_TABLE5:
        for recompute, sp, seconds in (("full", False, full), ("selective", True, selective)):
            par = Parallel(tp=tp, pp=pp, dp=n // (tp * pp), recompute=recompute, sp=sp, zero=0)
            bd = step_time(gpt(a, h, layers), par, cluster, batch, software="megatron-2022")
            label = f"{name} {'full' if recompute == 'full' else 'SP+selective'}"
            rows.append(Row(label, seconds, bd.seconds, "s per iteration"))
    return rows


def shoeybi() -> list[Row]:
    """Weak-scaling efficiency: per-GPU FLOP/s of each run over the 1.2B model's on one GPU."""
    cluster = Cluster(GPUS["v100"], 16)

    def per_gpu(a, h, layers, tp, dp=1):
        par = Parallel(tp=tp, dp=dp, micro_batch=8, recompute="full", zero=0)
        return step_time(gpt(a, h, layers, seq=1024), par, cluster, 8 * dp,
                         software="megatron-core").flops_per_gpu
    base = per_gpu(*SHOEYBI_WEAK[0][1:5])
    rows = [Row(f"{name} on {tp} GPU{'s' * (tp > 1)}", measured, per_gpu(a, h, layers, tp) / base,
                "weak-scaling efficiency")
            for name, a, h, layers, tp, measured in SHOEYBI_WEAK if measured]
    dp, measured = SHOEYBI_DP
    name, a, h, layers, tp, _ = SHOEYBI_WEAK[-1]
    rows.append(Row(f"{name} on {tp * dp} GPUs", measured, per_gpu(a, h, layers, tp, dp) / base,
                    "weak-scaling efficiency"))
    return rows


def summary(rows: list[Row]) -> str:
    lines = [f"{r.name:<22} measured {r.measured:8.4g}  predicted {r.predicted:8.4g}  "
             f"error {100 * r.error:+6.1f}%" for r in rows]
    errors = [abs(r.error) for r in rows]
    lines.append(f"{rows[0].unit}: mean |error| {100 * sum(errors) / len(errors):.1f}%, "
                 f"worst {100 * max(errors):.1f}%")
    return "\n".join(lines)
