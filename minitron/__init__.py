"""minitron: Megatron-LM's parallelism, small enough to read, checked against one device."""
from .runtime.comm import CommCounter, Group
from .grid import Grid, ParallelConfig, build_grid, pad_vocab_size
from .runtime.launch import RankError, launch
from .runtime.pool import WorkerPool

__version__ = "0.1.0"
__all__ = ["CommCounter", "Group", "Grid", "ParallelConfig", "build_grid", "pad_vocab_size",
           "RankError", "WorkerPool", "launch"]
