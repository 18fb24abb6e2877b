"""What the time model is given: the split of one step over a cluster (Parallel: the degrees,
the micro-batch, ZeRO, recomputation, the schedule) and the cluster (Cluster: the GPU and how
many share a node). Every term of the step (layer_time, pipeline_time, optimizer_time) reads them."""
from __future__ import annotations

import dataclasses

from ..hardware import GPU


@dataclasses.dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"      # "interleaved" when virtual > 1
    trim: int = 0               # uneven stages: the first and last stage hold `trim` layers fewer
    #                             (interleaved: the first chunk of the first rank, the last of the last)

    def stage_layers(self, n_layers: int) -> int:
        """Layers of a middle rank, all its chunks: (n + 2 trim) / pp (all equal when trim is 0)."""
        return (n_layers + 2 * self.trim) // self.pp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    def label(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
        if self.virtual > 1:
            parts.append(f"v{self.virtual}")
        parts += [f"dp{self.dp}"] + [f"{d}{getattr(self, d)}" for d in ("cp", "ep") if getattr(self, d) > 1]
        parts += [f"trim{self.trim}"] if self.trim else []
        parts += [f"mb{self.micro_batch}", f"zero{self.zero}", self.recompute, self.schedule]
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
