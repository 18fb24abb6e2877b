"""The GPU check's training step: a GPT of about 350M parameters in bf16 on one GPU, one step at a
time through minitron.train.engine.TrainingRun, three ways: eager, with the fused kernels
(--kernels), and with every block compiled (nn.Module.compile, as torchtitan compiles per block).

    python -m minitron.bench gpu --part train [--csv PATH] [--smoke] [--variants eager ...]

Each row: median step time of the timed steps after the warm-up ones (synchronised: the step's
kernels, not their launch), tokens/s, and MFU against the GPU's peak (minitron/hardware.py) for
the model FLOPs of a step (6 x params x tokens plus attention, estimate.flops.iteration_flops),
and beside it the planner's prediction for the same step on that GPU (planner_step_s: the time
model of python -m minitron.estimate plan, estimate/time_model.py, on the GPU's data sheet).
The rank is a minitron.launch rank of world size 1, on cuda:0 under NCCL where there is a GPU.
--smoke: a tiny model, any device, to check the code path (its timings mean nothing).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..estimate import flops
from ..estimate.memory import rank_params
from ..grid import ParallelConfig
from ..config import ModelConfig

VARIANTS = ("eager", "kernels", "compile")
BATCH, WARMUP, TIMED = 8, 2, 3
FIELDS = ["variant", "params", "batch", "seq", "step_s", "tokens_per_s", "mfu", "peak",
          "planner_step_s", "peak_memory_gb", "loss", "error"]


def gpt_350m() -> ModelConfig:
    """GPT-2 medium's shape (24 x 1024, 16 heads, tied embedding): about 355M parameters."""
    return ModelConfig(vocab_size=50304, seq_len=1024, hidden=1024, n_layers=24, n_heads=16,
                       tie_embeddings=True, dropout=0.0)


def planner_step_s(cfg: ModelConfig, batch: int, device_name: str) -> float | None:
    """The planner's step time for this step (one GPU, the whole batch as one micro-batch), on
    the data-sheet GPU that `device_name` ("NVIDIA H200", ...) is; None for one it has no sheet of."""
    from ..hardware import GPUS
    from ..estimate.time_model import Cluster, Parallel, step_time
    key = next((k for k in GPUS if k in device_name.lower()), None)
    if key is None:
        return None
    par = Parallel(micro_batch=batch, zero=0)
    return step_time(cfg, par, Cluster(GPUS[key], gpus_per_node=1), global_batch=batch).seconds


def tiny() -> ModelConfig:
    return ModelConfig(vocab_size=128, seq_len=32, hidden=64, n_layers=2, n_heads=4, tie_embeddings=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg: ModelConfig, variant: str, batch: int, warmup: int, timed: int) -> dict:
    """One variant's row, on this (launched) rank."""
    from ..train.engine import TrainingRun
    mcfg = dataclasses.replace(cfg, use_kernels=variant == "kernels")
    run = TrainingRun(mcfg, ParallelConfig(tp=1), dtype=torch.bfloat16, lr=1e-4, max_norm=1.0)
    if variant == "compile":
        for block in run.model.layers.values():
            block.compile()
    device = run.grid.device
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    tokens, targets = data[:, :-1], data[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, loss = [], None
    for step in range(warmup + timed):
        _sync(device)
        t0 = time.perf_counter()
        loss = run.step(tokens, targets, step)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    step_s = statistics.median(seconds[warmup:])
    found = flops.detect_peak() if device.type == "cuda" else None
    peak = found[0] if found else None
    rate = flops.throughput(mcfg, batch, step_s, gpus=1, peak=peak)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {"variant": variant, "params": rank_params(cfg), "batch": batch, "seq": cfg.seq_len,
            "step_s": round(step_s, 4), "tokens_per_s": round(rate["tokens/s"]),
            "mfu": "" if peak is None else round(rate["MFU"], 3),
            "peak": "" if found is None else found[1],
            "planner_step_s": "" if found is None else _rounded(planner_step_s(cfg, batch, found[1])),
            "peak_memory_gb": round(memory, 1), "loss": round(loss, 3), "error": ""}


def _rounded(seconds: float | None):
    return "" if seconds is None else round(seconds, 4)


def rank_rows(cfg: ModelConfig, variants, batch: int, warmup: int, timed: int) -> list[dict]:
    """Every variant on this rank; one that fails is a row saying why, and the next still runs."""
    rows = []
    for variant in variants:
        try:
            rows.append(measure(cfg, variant, batch, warmup, timed))
        except Exception as e:   # the check goes on: the table says what failed
            rows.append({**dict.fromkeys(FIELDS, ""), "variant": variant,
                         "error": f"{type(e).__name__}: {e}"[:300]})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def run(variants=VARIANTS, smoke: bool = False) -> list[dict]:
    """Launch one rank (nccl on cuda:0 where there is a GPU) and measure every variant there."""
    from ..model.fused import enable_kernels
    from ..runtime.launch import launch
    cfg = tiny() if smoke else gpt_350m()
    if "kernels" in variants:
        enable_kernels(dataclasses.replace(cfg, use_kernels=True), 1)
    batch, warmup, timed = (2, 1, 1) if smoke else (BATCH, WARMUP, TIMED)
    return launch(rank_rows, cfg, tuple(variants), batch, warmup, timed, world_size=1,
                  timeout=600)[0]
