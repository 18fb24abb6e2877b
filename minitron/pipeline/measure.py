"""A schedule run on real processes, measured: every rank's timed actions and peak activations.

measure() returns an actions.Timeline of the same form as the simulator's (pipeline/simulate.py),
so a real run can be drawn beside its simulation; measure_memory() returns each pipeline rank's
peak activations, as pipeline/check.py predicts them. The ranks run executor.run_schedule.
"""
from __future__ import annotations

from fractions import Fraction

import torch

from ..grid import Grid, ParallelConfig, build_grid
from ..config import ModelConfig
from ..runtime import comm
from ..runtime.launch import launch
from .actions import COMPUTE, Event, Schedule, Timeline
from .executor import run_schedule
from ..model.stages import PipelineGPT


def gather_timeline(schedule: Schedule, events: list[Event], grid: Grid) -> Timeline:
    """Every pipeline rank's events, on every rank (one counted all-gather over pp), with time
    measured from the earliest start, in seconds."""
    width = max(len(schedule.compute(r)) for r in range(schedule.pp))
    rows = torch.full((width, 6), -1.0, dtype=torch.float64, device=grid.device)
    for i, e in enumerate(events):
        rows[i] = torch.tensor([e.rank, COMPUTE.index(e.kind), e.microbatch, e.stage, e.start, e.end],
                               dtype=torch.float64)
    every = comm.all_gather(rows.unsqueeze(0), grid.pp, dim=0).reshape(-1, 6).cpu()
    every = every[every[:, 0] >= 0]
    t0 = every[:, 4].min().item()
    return Timeline(schedule.name, schedule.pp, [
        Event(int(r), COMPUTE[int(k)], int(mb), int(s), start - t0, end - t0)
        for r, k, mb, s, start, end in every.tolist()])


def _measure_rank(schedule: Schedule, mcfg: ModelConfig, pcfg: ParallelConfig, batch: int,
                  seed: int, steps: int, track_memory: bool):
    grid = build_grid(pcfg)
    model = PipelineGPT(mcfg, grid, schedule.stage_rank, seed=seed).train()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, mcfg.vocab_size, (batch, mcfg.seq_len + 1), generator=gen).to(grid.device)
    for step in range(steps):     # the first runs pay one-off costs (allocations, lazy inits)
        model.zero_grad(set_to_none=True)
        model.rng.reset(seed * 1_000 + step)
        result = run_schedule(schedule, model, data[:, :-1], data[:, 1:], keep_outputs=False,
                              track_memory=track_memory, start_line=True)
    timeline = gather_timeline(schedule, result.events, grid)
    peak = torch.tensor([[result.peak_alive, result.peak_bytes]], dtype=torch.float64, device=grid.device)
    peaks = comm.all_gather(peak, grid.pp, dim=0).cpu().tolist()
    return (timeline, peaks) if grid.rank == 0 else None


def _launch_measure(schedule, model_config, parallel_config, batch, seed, steps, track_memory):
    pcfg = parallel_config or ParallelConfig(pp=schedule.pp, virtual_pp=schedule.virtual)
    if pcfg.pp != schedule.pp:
        raise ValueError(f"schedule {schedule.name!r} is for pp={schedule.pp}, the parallel config "
                         f"has pp={pcfg.pp}")
    batch = batch or schedule.microbatches
    return launch(_measure_rank, schedule, model_config, pcfg, batch, seed, steps, track_memory,
                  world_size=pcfg.world_size)[0]


def measure(schedule: Schedule, model_config: ModelConfig, parallel_config: ParallelConfig | None = None,
            batch: int | None = None, seed: int = 0, steps: int = 2) -> Timeline:
    """Run `schedule` on real processes (one per rank) and return the measured Timeline of the
    last of `steps` steps: every rank's F, B, W, BW with start and end in seconds.

    parallel_config defaults to ParallelConfig(pp=schedule.pp); batch to one sample per
    micro-batch. The ranks are started with minitron.launch (gloo on CPU, NCCL on GPUs)."""
    return _launch_measure(schedule, model_config, parallel_config, batch, seed, steps, False)[0]


def measure_memory(schedule: Schedule, model_config: ModelConfig,
                   parallel_config: ParallelConfig | None = None, batch: int | None = None,
                   seed: int = 0) -> dict[int, tuple[Fraction, int]]:
    """Run one step of `schedule` on real processes; per pipeline rank, its measured peak
    activations: (micro-batches alive, in full-stage units as check() predicts them, and bytes)."""
    peaks = _launch_measure(schedule, model_config, parallel_config, batch, seed, 1, True)[1]
    return {r: (Fraction(int(alive), schedule.virtual), int(nbytes))
            for r, (alive, nbytes) in enumerate(peaks)}
