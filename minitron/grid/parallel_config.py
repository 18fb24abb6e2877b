"""ParallelConfig: how many ways each dimension is split, and the rank arithmetic of the grid
(pure: lessons draw it without any processes). Its groups are built by groups.py."""
from __future__ import annotations

import dataclasses
from itertools import product

from ..config import ConfigError
from ..runtime import placement
from .dims import CP_VARIANTS, DIMS, GROUP_DIMS
from .groups import Grid, build_grid
from .subgroups import digit_sizes, expand, settle_splits, split_size


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Smallest size >= vocab_size divisible by tp * multiple (Megatron pads the same way)."""
    step = tp * multiple
    return -(-vocab_size // step) * step


_QUIET_AT_DEFAULT = ("dp_shard", "cp_a2a", "tp_comm_overlap")


@dataclasses.dataclass(frozen=True, repr=False)
class ParallelConfig:
    """How many ways each dimension is split. SP rides on TP and adds no ranks."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    virtual_pp: int = 1  # model chunks per pipeline rank (interleaved schedules)
    # How attention reaches the other cp ranks' keys and values (minitron/context_parallel):
    # "ring" (K/V passed around, overlapped), "allgather" (gathered once), "ulysses" (all-to-all
    # to a head split; heads/tp must divide by cp), "hierarchical" (Ulysses inside groups of
    # cp_a2a ranks, a ring across them: subgroups.py)
    cp_variant: str = "ring"
    dp_shard: int | None = None   # HSDP: ZeRO shards over dp_shard ranks, dp/dp_shard replicas (default dp)
    cp_a2a: int | None = None     # hierarchical cp: the all-to-all group's size, dividing cp
    # devices per node: which groups leave one (minitron/runtime/placement.py); not part of the split
    gpus_per_node: int = dataclasses.field(default=8, repr=False, compare=False)
    # Hide SP's all-gather / reduce-scatter behind the column / row GEMMs, chunk by chunk
    # around a ring (minitron/tensor_parallel/overlap.py); the same bytes, the same numbers
    tp_comm_overlap: bool = False

    def __post_init__(self):
        for name in (*DIMS, "virtual_pp", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError("{%s} must be a positive integer" % name, {name: value}, [{name: 1}],
                                  note=f"ParallelConfig.{name}")
        if self.cp_variant not in CP_VARIANTS:
            raise ConfigError("{cp_variant}: choose one of %s" % (CP_VARIANTS,),
                              {"cp_variant": self.cp_variant}, [{"cp_variant": "ring"}])
        settle_splits(self)                            # dp_shard, cp_a2a (subgroups.py)
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("{sequence_parallel} shards the norm/dropout regions across the "
                              "tensor-parallel group, so it needs tp > 1, not {tp}",
                              {"sequence_parallel": True, "tp": 1},
                              [{"tp": 2}, {"sequence_parallel": False}])
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ConfigError("{tp_comm_overlap} hides sequence parallelism's all-gather and "
                              "reduce-scatter behind the GEMMs beside them: without SP "
                              "({sequence_parallel}) there are none",
                              {"tp_comm_overlap": True, "sequence_parallel": False},
                              [{"sequence_parallel": True, **({"tp": 2} if self.tp == 1 else {})},
                               {"tp_comm_overlap": False}])

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    @property
    def dp_replicate(self) -> int:
        """Copies of each ZeRO shard (HSDP; 1 when dp_shard is all of dp)."""
        return self.dp // split_size(self, "dp")

    def __repr__(self) -> str:       # the later options print only when set, so old outputs hold
        fields = (f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if f.repr and not (f.name in _QUIET_AT_DEFAULT and getattr(self, f.name) == f.default))
        return f"ParallelConfig({', '.join(fields)})"

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def build(self) -> "Grid":
        """This rank's Grid with every process group (collective: every rank calls it)."""
        return build_grid(self)

    # ---- pure arithmetic on the grid: usable without any processes (lessons draw it) ----
    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for d in DIMS:
            rank, out[d] = divmod(rank, getattr(self, d))
        return out

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for d in reversed(DIMS):
            rank = rank * getattr(self, d) + coords.get(d, 0)
        return rank

    def group_ranks(self, dims: tuple[str, ...]) -> list[list[int]]:
        """All groups in which exactly `dims` vary (whole dimensions or the digits of
        subgroups.py), each a sorted list of global ranks."""
        sizes, dims = digit_sizes(self), expand(dims)
        fixed = [d for d in sizes if d not in dims]

        def rank(digits: dict) -> int:
            r = 0
            for d in reversed(sizes):
                r = r * sizes[d] + digits[d]
            return r

        groups = []
        for outer in product(*(range(sizes[d]) for d in fixed)):
            base = dict(zip(fixed, outer))
            members = [rank({**base, **dict(zip(dims, inner))})
                       for inner in product(*(range(sizes[d]) for d in dims))]
            groups.append(sorted(members))
        return sorted(groups)  # listed by first rank, as Megatron prints them: [[0,1],[2,3],...]

    def node_crossing_groups(self) -> dict[str, list[list[int]]]:
        """Each group kind's groups whose ranks sit on more than one node (runtime/placement.py)."""
        return placement.crossing_groups(self)

    def group_kinds(self) -> dict[str, list[list[int]]]:
        """Every kind of group the grid builds (GROUP_DIMS), and the embedding's: {name: groups}."""
        kinds = {name: self.group_ranks(dims) for name, dims in GROUP_DIMS.items()}
        kinds["embedding"] = self.embedding_ranks()
        return kinds

    def embedding_ranks(self) -> list[list[int]]:
        """First and last pipeline stage of every pipeline (one rank when pp == 1)."""
        return [sorted({g[0], g[-1]}) for g in self.group_ranks(("pp",))]

    # ---- validation: fail before any communication, say what to change ----
    # (whether a model splits on this grid is the model's check: model/splits.validate_model)
    def validate(self, world_size: int | None = None) -> None:
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != tp*cp*ep*dp*pp = {self.tp}*{self.cp}*{self.ep}*"
                f"{self.dp}*{self.pp} = {self.world_size}: launch {self.world_size} ranks or change "
                f"the split so the product is {world_size}")
