"""The rank grid: which rank holds which piece, and every process group built once.

World size = tp * cp * ep * dp * pp. Ranks are laid out Megatron's way, "tp-cp-ep-dp-pp":
tp varies fastest (neighbouring ranks share a tensor-parallel group, so TP stays inside a
node), pp slowest. A rank's coordinates are the digits of its number in that mixed radix.

  rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

Which groups exist, and what travels in each:
  tp        tensor-parallel shards of one layer        (activations: all-reduce / SP pair)
  cp        chunks of one sequence                     (keys/values around a ring)
  ep        experts of one MoE layer                   (tokens: all-to-all)
  dp        replicas fed different batches             (gradients)
  pp        stages of one pipeline                     (activations: send/recv)
  dp_cp     ranks holding the same expert weights      (expert gradients: dp x cp)
  dense_dp  ranks holding the same dense weights       (dense gradients: dp x cp x ep —
            expert-parallel ranks see different tokens, so for dense layers they are
            data-parallel replicas too)
  tp_ep     ranks exchanging one MoE layer's tokens    (tp x ep: with sequence parallelism
            every TP rank holds different tokens, so dispatch spans both)
  ep_dp     ranks fed different rows of the batch      (dp x ep; cp ranks share rows and
            split their sequences: the engine gathers a step's outputs over ep_dp)
  amax      ranks casting pieces or replicas of one    (tp x cp x ep x dp: FP8 amaxes, all-
            FP8 tensor                                 reduced so all cast it with one scale)
  embedding first and last pipeline stage              (tied embedding gradients)

Where this differs from Megatron-Core (megatron/core/parallel_state.py): minitron builds
every group, expert groups included, from the one "tp-cp-ep-dp-pp" layout above. Current
Megatron-Core uses two rank generators: the dense one (tp-cp-dp-pp, ep = 1) and an expert
one that folds cp away (tp = expert tp, cp = 1, ep, dp = world / (etp * ep * pp)). With
cp = 1 or ep = 1 every group agrees; with cp > 1 and ep > 1 the expert groups differ. At
tp=1, cp=2, ep=2 (4 ranks):
  minitron        ep [[0, 2], [1, 3]]   expert grads (dp_cp) [[0, 1], [2, 3]]
  Megatron-Core   ep [[0, 1], [2, 3]]   expert dp            [[0, 2], [1, 3]]
(the cp groups agree: [[0, 1], [2, 3]]). Each is a valid layout; a rank that holds a given
expert in one does not in the other, so expert checkpoints and rank maps do not carry over
as they are. Runs use minitron's layout (experts use tp); moe/expert_layout.py computes
Megatron-Core's, with an expert tensor-parallel size of its own, for comparison and --explain.
"""
from __future__ import annotations

import dataclasses
from itertools import product

import torch
import torch.distributed as dist

from .config import ConfigError
from .runtime import comm, placement
from .runtime.comm import Group
from .subgroups import SUBGROUP_DIMS, digit_sizes, expand, same_group, settle_splits, split_size

DIMS = ("tp", "cp", "ep", "dp", "pp")  # fastest first
CP_VARIANTS = ("ring", "allgather", "ulysses", "hierarchical")

# group name -> the dimensions that vary inside it
GROUP_DIMS = {
    "tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "dp": ("dp",), "pp": ("pp",),
    "dp_cp": ("cp", "dp"), "dense_dp": ("cp", "ep", "dp"), "tp_ep": ("tp", "ep"),
    "ep_dp": ("ep", "dp"),
}
# FP8's amax reduction group (Megatron-Core's): every rank holding a piece or a replica of a dense
# layer's tensors, so one logical tensor is cast with one scale (tensor_parallel/fp8.py)
AMAX_DIMS = ("tp", "cp", "ep", "dp")


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


class Grid:
    """This rank's place on the grid and its process groups. Built once per config.

    Every rank must build the same grids in the same order (new_group is collective).
    """

    def __init__(self, config: ParallelConfig):
        world = dist.get_world_size() if dist.is_initialized() else 1
        config.validate(world_size=world)
        self.config = config
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = world
        self.coords = config.coords(self.rank)
        if self.rank == 0:
            placement.warn_if_tp_crosses_nodes(config)   # a TP group spanning nodes: one line
        self.device = _default_device()
        self.groups: dict[str, Group] = {}
        for name, dims in GROUP_DIMS.items():
            self.groups[name] = _build(name, config.group_ranks(dims), self.rank)
        self.groups["embedding"] = _build("embedding", config.embedding_ranks(), self.rank)
        self.groups["amax"] = _build("amax", config.group_ranks(AMAX_DIMS), self.rank)
        for name, dims in SUBGROUP_DIMS.items():     # HSDP's and hierarchical cp's (subgroups.py)
            same = same_group(config, name)
            self.groups[name] = self.groups[same] if same else \
                _build(name, config.group_ranks(dims), self.rank)
        # The names read like Megatron's: grid.tp is this rank's tensor-parallel group (a
        # comm.Group: .ranks, .rank, .size), grid.tp_rank its coordinate along tp. The
        # module docstring's table says what travels in each group.
        self.tp = self.groups["tp"]
        self.cp = self.groups["cp"]
        self.ep = self.groups["ep"]
        self.dp = self.groups["dp"]
        self.pp = self.groups["pp"]
        self.dp_cp = self.groups["dp_cp"]
        self.dense_dp = self.groups["dense_dp"]
        self.tp_ep = self.groups["tp_ep"]
        self.ep_dp = self.groups["ep_dp"]
        self.amax = self.groups["amax"]
        self.embedding = self.groups["embedding"]
        self.dense_dp_shard = self.groups["dense_dp_shard"]
        self.dp_cp_shard = self.groups["dp_cp_shard"]
        self.dp_replicate = self.groups["dp_replicate"]
        self.cp_a2a = self.groups["cp_a2a"]
        self.cp_ring = self.groups["cp_ring"]
        self.tp_rank = self.coords["tp"]
        self.cp_rank = self.coords["cp"]
        self.ep_rank = self.coords["ep"]
        self.dp_rank = self.coords["dp"]
        self.pp_rank = self.coords["pp"]

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel

    @property
    def tp_comm_overlap(self) -> bool:
        return self.config.tp_comm_overlap

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.config.pp - 1

    def describe(self) -> str:
        c = ", ".join(f"{d}={self.coords[d]}" for d in DIMS)
        return f"rank {self.rank}: {c}"

    def __repr__(self) -> str:
        return f"Grid({self.config}, {self.describe()})"


def _build(name: str, all_ranks: list[list[int]], me: int) -> Group:
    mine = None
    for ranks in all_ranks:
        pg = _process_group(ranks) if len(ranks) > 1 else None
        if me in ranks:
            mine = Group(name, ranks, pg)
    if mine is None and name == "embedding":   # a middle pipeline stage: no embedding to share
        mine = Group(name, [me])
    assert mine is not None, f"rank {me} is in no {name} group"
    return mine


# Process groups by their ranks, for the world they were made in. Grids share them: tp's
# [0, 1] of one config is dp's [0, 1] of another, and one gloo group (threads and sockets of
# its own) serves both. A rank pool that builds dozens of grids then holds a few groups, not
# hundreds. Every rank builds the same grids in the same order, so every rank's cache holds
# the same keys and skips the same new_group calls (which must be entered by all ranks).
_WORLD: list = [None]
_GROUPS: dict[tuple[int, ...], object] = {}
_GRIDS: dict[tuple[ParallelConfig, int], Grid] = {}


def _this_world() -> None:
    """Forget the groups and grids of a destroyed world (after destroy + init they are stale)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not _WORLD[0]:
        _WORLD[0] = world
        _GROUPS.clear()
        _GRIDS.clear()


def _process_group(ranks: list[int]):
    _this_world()
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks, timeout=comm.TIMEOUT)
    return _GROUPS[key]


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_grid(config: ParallelConfig) -> Grid:
    """The Grid for `config`, built on first use and reused (creating groups is slow).

    A cached grid belongs to the world it was built in: after the process group is
    destroyed and initialised again, the groups are built anew."""
    _this_world()
    key = (config, config.gpus_per_node)     # equal configs on other nodes warn differently
    if key not in _GRIDS:
        _GRIDS[key] = Grid(config)
    return _GRIDS[key]


__all__ = ["DIMS", "CP_VARIANTS", "GROUP_DIMS", "AMAX_DIMS", "ParallelConfig", "Grid", "build_grid", "pad_vocab_size"]
