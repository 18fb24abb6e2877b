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
from .dims import AMAX_DIMS, CP_VARIANTS, DIMS, GROUP_DIMS
from .groups import Grid, build_grid
from .parallel_config import ParallelConfig, pad_vocab_size

__all__ = ["DIMS", "CP_VARIANTS", "GROUP_DIMS", "AMAX_DIMS", "ParallelConfig", "Grid", "build_grid", "pad_vocab_size"]
