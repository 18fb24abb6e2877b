"""Where the ranks land on real machines: nodes of `gpus_per_node` devices, and which groups leave one.

A launcher numbers the GPUs of node 0 first (torchrun: rank = node_rank * nproc_per_node +
local_rank), so rank r sits on node r // gpus_per_node. A group whose ranks sit on one node talks
over NVLink; a group that spans nodes leaves them through the nodes' NICs: a ring collective
with k members on each node drives k NICs (minitron/hardware.py, the one link model; the warning
below quotes its DGX H100 figures).

Tensor parallelism all-reduces between two matmuls that wait for it, every layer, so a TP group
that leaves the node slows every step: building the grid warns (PlacementWarning, one line
naming the group; `python -m minitron.verify` prints it before any rank starts). Which groups cross a node: crossing_groups(cfg); every kind with its ranks and
whether it stays inside a node: explain(cfg), printed by `python -m minitron.verify --explain`.

Here in runtime/ because this is where ranks meet machines (launch.py gives each rank its
device); the grid's own module holds only the arithmetic of coordinates.
"""
from __future__ import annotations

import warnings

from ..hardware import GPUS, ring_link

QUOTED_GPU = "h100"      # the machine the warning's bandwidths are quoted for
SHOWN_GROUPS = 8         # explain() lists this many groups of a kind, then says how many more


class PlacementWarning(UserWarning):
    """A group that will run at the network's bandwidth, not NVLink's."""


def node_of(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


def nodes_spanned(ranks: list[int], gpus_per_node: int) -> int:
    return len({node_of(r, gpus_per_node) for r in ranks})


def crossing_groups(cfg) -> dict[str, list[list[int]]]:
    """For each kind that has any, the groups whose ranks sit on more than one node."""
    g = cfg.gpus_per_node
    out = {name: [ranks for ranks in groups if nodes_spanned(ranks, g) > 1]
           for name, groups in cfg.group_kinds().items()}
    return {name: groups for name, groups in out.items() if groups}


def tp_warning(cfg) -> str | None:
    """One line when a tensor-parallel group spans nodes, else None."""
    g = cfg.gpus_per_node
    if cfg.tp == 1 or g % cfg.tp == 0 or cfg.world_size <= g:     # tp blocks fit inside nodes
        return None
    for ranks in cfg.group_ranks(("tp",)):
        if nodes_spanned(ranks, g) > 1:
            k = min(sum(node_of(r, g) == node for r in ranks) for node in {node_of(r, g) for r in ranks})
            gpu = GPUS[QUOTED_GPU]
            across, inside = ring_link(gpu, len(ranks), k)[0], ring_link(gpu, len(ranks), len(ranks))[0]
            return (f"tp group {_short(ranks)} spans {nodes_spanned(ranks, g)} nodes of {g} GPUs: "
                    f"its all-reduces, which every layer waits for, leave each node through {k} "
                    f"NIC{'s' * (k > 1)} (at H100 rates {across / 1e9:.0f} GB/s of bus bandwidth, not "
                    f"NVLink's {inside / 1e9:.0f}) and pay the network's latency at each ring step (keep tp a divisor of gpus_per_node={g})")
    return None


def warn_if_tp_crosses_nodes(cfg) -> None:
    """Warn (PlacementWarning) when a tensor-parallel group spans nodes; the grid calls it as it is
    built (rank 0), so the arithmetic on a ParallelConfig (lessons, estimates) stays quiet."""
    message = tp_warning(cfg)
    if message is not None:
        warnings.warn(message, PlacementWarning, stacklevel=3)   # points at the Grid(...) line


def explain(cfg) -> str:
    """Each group kind: how many groups of how many ranks, whether every one stays inside a node,
    and its ranks (the first SHOWN_GROUPS groups). Megatron-Core's expert groups follow in
    moe/expert_layout.explain."""
    g = cfg.gpus_per_node
    nodes = -(-cfg.world_size // g)
    lines = [f"{cfg.world_size} ranks on {nodes} node{'s' * (nodes > 1)} of {g} GPUs "
             f"(tp={cfg.tp} cp={cfg.cp} ep={cfg.ep} dp={cfg.dp} pp={cfg.pp}, tp fastest)"]
    lines += [group_row(name, groups, g) for name, groups in cfg.group_kinds().items()]
    return "\n".join(lines)


def group_row(name: str, groups: list[list[int]], gpus_per_node: int) -> str:
    """One line of explain(): the kind, its groups' sizes, whether they stay inside a node."""
    size = "/".join(str(s) for s in sorted({len(ranks) for ranks in groups}))
    if size == "1":                           # nothing travels in a group of one rank
        return f"  {name:<12} {len(groups):>4} x 1   one rank each: no traffic"
    spans = max(nodes_spanned(ranks, gpus_per_node) for ranks in groups)
    where = "inside a node" if spans == 1 else f"CROSSES nodes (up to {spans})"
    shown = ", ".join(_short(ranks) for ranks in groups[:SHOWN_GROUPS])
    more = f", ... {len(groups) - SHOWN_GROUPS} more" if len(groups) > SHOWN_GROUPS else ""
    return f"  {name:<12} {len(groups):>4} x {size:<3} {where:<26} {shown}{more}"


def _short(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> [0-3]; anything not a run of consecutive ranks is listed in full."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ", ".join(map(str, ranks)) + "]"


__all__ = ["PlacementWarning", "node_of",
           "nodes_spanned", "crossing_groups", "tp_warning", "warn_if_tp_crosses_nodes",
           "explain", "group_row"]
