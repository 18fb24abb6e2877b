"""minitron: Megatron-LM's parallelism, small enough to read, checked against one device.

The package stands on floors. A file imports only from its own floor or below, never from a
floor above (not even inside a function), and no two files import each other, directly or
around a loop (tests/test_layering.py reads the floors from these lines):

  floor 0  runtime grid config refusals hardware sources kernels
  floor 1  tensor_parallel context_parallel moe pipeline data_parallel
  floor 2  model pipeline.measure
  floor 3  estimate plan
  floor 4  train
  floor 5  verify grade bench pipeline.__main__

What each floor holds:
  0  how ranks start and talk (runtime/), the grid of process groups, the two configs
     (ModelConfig in config.py, ParallelConfig in grid/), the one table of refused
     combinations (refusals/), the GPUs' data sheets and link model (hardware.py), the
     constants the lessons cite with their sources (sources.py) and the Triton
     kernels: everything above reads them.
  1  the parallel pieces, each on its own: layers split over tp, attention over cp,
     experts over ep, pipeline schedules and their executor, data-parallel engines.
     They take a model as an argument and call it; none imports the model.
  2  the GPT: one device, split over a grid (ParallelGPT), cut into pipeline stages
     (PipelineGPT, model/stages.py); pipeline/measure.py times a schedule on it.
  3  estimates from a model's shape: memory, FLOPs, step time, the planner, and their
     command line (python -m minitron.estimate plan / memory / flops; python -m minitron.plan
     for short).
  4  a training run: its engine, checkpoints, restarts, the command line.
  5  what checks, grades or measures the rest, and the pipeline's command line
     (python -m minitron.pipeline).
"""
from .runtime.comm import CommCounter, Group
from .grid import Grid, ParallelConfig, build_grid, pad_vocab_size
from .runtime.launch import RankError, launch
from .runtime.pool import WorkerPool

__version__ = "0.1.0"
__all__ = ["CommCounter", "Group", "Grid", "ParallelConfig", "build_grid", "pad_vocab_size",
       "RankError", "WorkerPool", "launch"]
