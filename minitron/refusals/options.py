"""What a run combines (Options), in ParallelConfig's and ModelConfig's field names."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LEVELS = ("model", "engine", "verify")
SIXTEEN_BIT = ("bfloat16", "float16")
V_SHAPED = ("zb-v", "dualpipev")      # the first and the last stage on one rank (pipeline/schedules.py)


@dataclass(frozen=True)
class Options:
    """What a run combines, in ParallelConfig's and ModelConfig's field names. The defaults are a
    plain single-device float32 run. dtype is --dtype's name (fp8: bfloat16 with FP8 GEMMs);
    schedule a pipeline schedule's name or None; zero None: no data-parallel engine asked for."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_pp: int = 1
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    cp_variant: str = "ring"
    dp_shard: int | None = None
    n_experts: int = 0
    capacity_factor: float | None = None
    aux_loss_scope: str = "global"
    tie_embeddings: bool = False
    recompute: str = "none"
    use_kernels: bool = False
    dropout_rng: str = "exact"
    dtype: str = "float32"
    fp8_recipe: str | None = None
    fp8_amax_unreduced: bool = False      # --no-fp8-amax-reduce (FP8Recipe.reduce_amax off)
    zero: int | None = None
    schedule: str | None = None
    reference_routing: bool = False

    @classmethod
    def of(cls, pcfg=None, mcfg=None, dtype=None, zero=None, schedule=None, fp8=None,
           reference_routing: bool = False) -> "Options":
        """From the engine's arguments: a ParallelConfig, a ModelConfig, a torch dtype, the
        ZeRO stage, a Schedule (or its name) and an FP8Recipe; any of them left out: the default."""
        o = {}
        if pcfg is not None:
            o.update(tp=pcfg.tp, pp=pcfg.pp, dp=pcfg.dp, cp=pcfg.cp, ep=pcfg.ep,
                     virtual_pp=pcfg.virtual_pp, sequence_parallel=pcfg.sequence_parallel,
                     tp_comm_overlap=pcfg.tp_comm_overlap, cp_variant=pcfg.cp_variant,
                     dp_shard=pcfg.dp_shard)
        if mcfg is not None:                  # a ModelConfig, or anything with its fields
            get = lambda name, default: getattr(mcfg, name, default)   # noqa: E731
            o.update(n_experts=get("n_experts", 0), capacity_factor=get("capacity_factor", None),
                     aux_loss_scope=get("aux_loss_scope", "global"),
                     tie_embeddings=get("tie_embeddings", False), recompute=get("recompute", "none"),
                     use_kernels=get("use_kernels", False),
                     dropout_rng=get("dropout_rng", "exact") if get("dropout", 0) > 0 else "exact")
        if dtype is not None:
            o["dtype"] = str(dtype).removeprefix("torch.")
        if fp8 is not None:                   # FP8 GEMMs in bfloat16 training: --dtype fp8
            o.update(fp8_recipe=fp8.scaling, fp8_amax_unreduced=not getattr(fp8, "reduce_amax", True),
                     dtype="fp8" if o.get("dtype", "bfloat16") == "bfloat16" else o["dtype"])
        if schedule is not None:
            o["schedule"] = schedule if isinstance(schedule, str) else schedule.name
        return cls(**o, zero=zero, reference_routing=reference_routing)

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None or self.pp > 1 or self.virtual_pp > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_shard is not None and self.dp_shard < self.dp

    @property
    def fp8(self) -> bool:
        return self.fp8_recipe is not None

    @property
    def engine(self) -> bool:
        """Whether the run steps through a data-parallel engine (train/engine.py uses_engine)."""
        return self.dp > 1 or self.ep > 1 or self.zero is not None or \
            self.dtype in (*SIXTEEN_BIT, "fp8")

    def with_(self, **changes) -> "Options":
        """These options changed (a fix); a pipeline's schedule goes with the pipeline."""
        new = dataclasses.replace(self, **changes)
        if new.dtype != "fp8" and "fp8_recipe" not in changes:     # out of FP8: no recipe
            new = dataclasses.replace(new, fp8_recipe=None, fp8_amax_unreduced=False)
        if new.pp == 1 and new.virtual_pp == 1 and "schedule" not in changes:
            new = dataclasses.replace(new, schedule=None)
        return new
