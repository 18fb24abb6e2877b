"""Mixture of experts and expert parallelism: router.py (top-k gating, capacity, auxiliary
losses), balance.py (aux-loss-free balancing: the expert bias and its update), experts.py (the
local experts as one batched matmul), dispatch.py (all-to-all and
all-gather token dispatch), layer.py (the expert-parallel layer), reference.py (one device);
expert_layout.py: which ranks form the expert groups, minitron's layout or Megatron-Core's."""
from .dispatch import AllGatherDispatcher, AllToAllDispatcher
from .experts import GroupedExperts
from .layer import ParallelMoE
from .reference import MoE
from .router import Routing, imbalance, route, update_expert_bias

__all__ = ["MoE", "ParallelMoE", "GroupedExperts", "AllToAllDispatcher", "AllGatherDispatcher",
           "Routing", "route", "imbalance", "update_expert_bias"]
