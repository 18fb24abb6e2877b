"""Which ranks form the expert groups: minitron's one generator, or Megatron-Core's second one.

minitron lays out every group, the experts' included, on the one "tp-cp-ep-dp-pp" grid
(minitron/grid/). Megatron-Core (megatron/core/parallel_state.py, initialize_model_parallel)
builds two RankGenerators over the same ranks:
  dense   tp, cp, dp = world / (tp * cp * pp), pp      (ep = 1: the dense dp holds ep * dp)
  expert  expert tp, ep, expert dp = world / (etp * ep * pp), pp      (cp = 1: folded away)
Its dense groups are minitron's (dense dp = ep_dp, dp-cp = dense_dp). Its expert groups differ
in two ways: cp is folded into the expert data-parallel dimension instead of sitting between tp
and ep, and the experts may have a tensor-parallel size of their own (expert_tp; a small expert
is often not split at all, etp = 1, while attention keeps tp = 8). With cp = 1 and etp = tp the
two layouts agree.

expert_groups(cfg, layout, expert_tp) returns, for either layout, the groups an expert layer
uses: expert_tp (splits one expert's matrices), ep (the all-to-all's ranks, one per expert
shard), expert_tp_ep (a MoE layer's token exchange with sequence parallelism) and expert_dp
(ranks holding the same expert weights: their gradients are averaged). The runs use minitron's
layout; Megatron-Core's is arithmetic here, for rank maps, checkpoints and lesson 12, and
tests/test_expert_layout.py checks it against Megatron-Core's own algorithm.
"""
from __future__ import annotations

from ..config import ConfigError, divisors, near
from ..grid import GROUP_DIMS, ParallelConfig
from ..runtime import placement

EXPERT_LAYOUTS = ("minitron", "megatron-core")


def expert_groups(cfg: ParallelConfig, layout: str = "minitron",
                  expert_tp: int | None = None) -> dict[str, list[list[int]]]:
    """The expert groups of `cfg` in `layout`, each a sorted list of sorted rank lists."""
    if layout not in EXPERT_LAYOUTS:
        raise ConfigError("{expert_layout}: choose one of %s" % (EXPERT_LAYOUTS,),
                          {"expert_layout": layout}, [{"expert_layout": "minitron"}])
    etp = cfg.tp if expert_tp is None else expert_tp
    if layout == "minitron":
        if etp != cfg.tp:
            raise ConfigError("minitron's experts are split over tp: {expert_tp} must equal {tp}",
                              {"expert_tp": etp, "tp": cfg.tp},
                              [{"expert_tp": cfg.tp}, {"expert_layout": "megatron-core"}])
        return {"expert_tp": cfg.group_ranks(GROUP_DIMS["tp"]), "ep": cfg.group_ranks(GROUP_DIMS["ep"]),
                "expert_tp_ep": cfg.group_ranks(GROUP_DIMS["tp_ep"]),
                "expert_dp": cfg.group_ranks(GROUP_DIMS["dp_cp"])}
    e = megatron_expert_grid(cfg, etp)
    return {"expert_tp": e.group_ranks(("tp",)), "ep": e.group_ranks(("ep",)),
            "expert_tp_ep": e.group_ranks(("tp", "ep")), "expert_dp": e.group_ranks(("dp",))}


def megatron_expert_grid(cfg: ParallelConfig, expert_tp: int) -> ParallelConfig:
    """The same ranks laid out as Megatron-Core's expert generator lays them out: its mixed
    radix is minitron's with cp = 1, so minitron's arithmetic (ParallelConfig.group_ranks) applies."""
    if not isinstance(expert_tp, int) or expert_tp < 1:
        raise ConfigError("{expert_tp} must be a positive integer", {"expert_tp": expert_tp},
                          [{"expert_tp": cfg.tp}])
    world, model_parallel = cfg.world_size, expert_tp * cfg.ep * cfg.pp
    if world % model_parallel:        # world = tp*cp*ep*dp*pp, so every divisor of the rest works
        works = near(divisors(world // (cfg.ep * cfg.pp)), expert_tp)
        raise ConfigError(f"{{expert_tp}} * {{ep}} * {{pp}} must divide the {world} ranks (the rest "
                          "is the experts' data parallelism)",
                          {"expert_tp": expert_tp, "ep": cfg.ep, "pp": cfg.pp},
                          [{"expert_tp": t} for t in works])
    return ParallelConfig(tp=expert_tp, ep=cfg.ep, dp=world // model_parallel, pp=cfg.pp,
                          gpus_per_node=cfg.gpus_per_node)



def explain(cfg: ParallelConfig, layout: str = "minitron", expert_tp: int | None = None) -> str:
    """runtime/placement.explain(cfg), then the expert groups of `layout` (with "megatron-core"
    those of Megatron-Core's second rank generator), each kind on one line the same way."""
    experts = expert_groups(cfg, layout, expert_tp)
    lines = [placement.explain(cfg),
             f"expert groups, {layout} layout (expert tp {len(experts['expert_tp'][0])}, "
             f"expert dp {len(experts['expert_dp'][0])}):"]
    lines += [placement.group_row(name, groups, cfg.gpus_per_node) for name, groups in experts.items()]
    return "\n".join(lines)


__all__ = ["EXPERT_LAYOUTS", "expert_groups", "megatron_expert_grid", "explain"]
