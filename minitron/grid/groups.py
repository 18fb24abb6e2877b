"""This rank's Grid: its coordinates and every process group, built once per config.

Process groups are cached by their ranks, so grids that name the same ranks share one."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm, placement
from ..runtime.comm import Group
from .dims import AMAX_DIMS, DIMS, GROUP_DIMS
from .subgroups import SUBGROUP_DIMS, same_group


class Grid:
    """This rank's place on the grid and its process groups. Built once per config.

    Every rank must build the same grids in the same order (new_group is collective).
    """

    def __init__(self, config: "ParallelConfig"):
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
_GRIDS: dict[tuple, Grid] = {}


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


def build_grid(config: "ParallelConfig") -> Grid:
    """The Grid for `config`, built on first use and reused (creating groups is slow).

    A cached grid belongs to the world it was built in: after the process group is
    destroyed and initialised again, the groups are built anew."""
    _this_world()
    key = (config, config.gpus_per_node)     # equal configs on other nodes warn differently
    if key not in _GRIDS:
        _GRIDS[key] = Grid(config)
    return _GRIDS[key]
