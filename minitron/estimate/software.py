"""The software a run used, as a named set of features: the one rule of the planner.

Every published run is modelled with the software of its date, with the features that existed
then, and with the settings its text (or its released launch script) states; the planner never
proposes a feature outside the setting it is given (`allows`). Nothing here is chosen per table:
a setting is the release, and the rows of every table of that release share it.

  megatron-2019   Shoeybi et al. 2019 (arXiv:1909.08053): tensor parallelism only (no pipeline),
                  activation checkpointing of every layer (§5: "checkpoint activations"), the
                  data-parallel all-reduce after the backward (§3/§5.1: the 2019 code's DDP
                  reduced the gradients once the backward had finished: pretrain_gpt2.py,
                  USE_TORCH_DDP = False, allreduce_params after loss.backward()), fp16
                  gradients, no fused softmax or bias-dropout-add (each its own kernel:
                  mpu/transformer.py of NVIDIA/Megatron-LM a0368ddf47, Aug 2019).
  megatron-2021   Narayanan et al. 2021 (arXiv:2104.04473): + pipelines with the interleaved
                  1F1B schedule and the scatter/gather optimization (§2.2.2, §4.1, used for
                  the §5 runs), full recomputation (§3.5); gradients all-reduced after the
                  backward by Megatron's local DDP, or during it by torch's DDP (the paper's
                  scripts, examples/sc21/run_table_1.sh, choose `DDP=torch` without a pipeline).
  megatron-2022   Korthikanti et al. 2022 (arXiv:2205.05198): + sequence parallelism (§4.2.2),
                  selective recomputation (§5), the weight-gradient GEMM accumulating into the
                  fp32 main grad (gradient-accumulation fusion), DP as in 2021, and the backward's TP
                  collectives asynchronous beside the GEMMs (megatron/mpu/layers.py's
                  LinearWithGradAccumulationAndAsyncCommunication, on by default since late 2021:
                  the dgrad all-reduce runs beside the wgrad GEMM; with SP the input is
                  all-gathered again beside the dgrad GEMM and the dgrad reduce-scattered beside
                  the wgrad GEMM; megatron/core/tensor_parallel/layers.py keeps it).
  megatron-core   Megatron-Core today: + context parallelism, the distributed optimizer
                  (ZeRO-1) and FSDP (ZeRO-3), DP communication overlapped with the backward
                  (--overlap-grad-reduce, also beside a pipeline), TP communication overlapped
                  with the GEMMs (--tp-comm-overlap, Transformer Engine), flash attention
                  (no s x s matrix in memory or in HBM traffic), gradients reduced in fp32
                  under bf16 (Megatron-LM's arguments force accumulate_allreduce_grads_in_fp32
                  for bf16), uneven pipeline stages (--decoder-first/last-pipeline-num-layers,
                  also with interleaving: --num-virtual-stages-per-pipeline-rank, or
                  --pipeline-model-parallel-layout such as "E|(t|)*3,m|m||L", megatron/training/
                  arguments.py), the interleaved schedule's stage-boundary sends overlapped with
                  the next chunk's compute (--no-overlap-p2p-communication turns off what is on
                  by default; megatron/core/pipeline_parallel/schedules.py).
  llama3-2024     Meta's stack as Dubey et al. 2024 (arXiv:2407.21783) describe it for Llama 3
                  405B, not Megatron: TP with sequence parallelism (§3.3.2 cites Korthikanti et
                  al. for TP), interleaved pipelines beside one-layer-lighter first and last
                  stages with asynchronous point-to-point sends (§3.3.2), all-gather context
                  parallelism, FSDP sharding gradients and optimizer state with the gradients
                  reduce-scattered in fp32 (§3.3.2, "Numerical stability"), overlapped with the
                  backward as PyTorch's FSDP does, no activation checkpointing at 8K tokens, and
                  flash attention (at 8K without checkpointing the s x s scores could not be
                  kept), taken as PyTorch's FlashAttention-2 at its published utilization on
                  Hopper (FLASH_ATTENTION_2 below). What the paper does not name it is taken not to have: TP's collectives
                  are synchronous (no overlap with the GEMMs is named; PyTorch's tensor
                  parallelism runs them so), and the gradients are accumulated in fp32 over the
                  micro-batches ("FP32 gradient accumulation during backward", §3.3.4) by adding
                  each micro-batch's 16-bit weight gradient into them, not by Megatron's fused
                  weight-gradient GEMM (gradient-accumulation fusion, an APEX/TE kernel).
  minitron        minitron's own engine (train/engine.py): every parallelism of this course,
                  ZeRO 0-3, eager attention (the s x s scores are materialised), DP overlapped
                  with the last micro-batch's backward without a pipeline, TP not overlapped.
"""
from __future__ import annotations

import dataclasses

from ..config import CHOICES

RECOMPUTES = CHOICES["recompute"]     # none, selective, full
# FlashAttention-2 on Hopper: "only 35% utilization on the H100 GPU" (Shah et al. 2024,
# FlashAttention-3, arXiv:2407.08608, abstract); the H200 has the H100's compute die. PyTorch's
# scaled_dot_product_attention has run FlashAttention-2 since PyTorch 2.2 (January 2024).
FLASH_ATTENTION_2 = (("H100", 0.35), ("H200", 0.35))


@dataclasses.dataclass(frozen=True)
class Software:
    name: str
    source: str
    pipeline: bool = True
    interleaving: bool = True           # interleaved 1F1B (and scatter/gather of PP messages)
    sequence_parallel: bool = False
    recomputes: tuple = ("none", "full")
    context_parallel: bool = False
    zeros: tuple = (0,)                 # ZeRO stages it offers (1: distributed optimizer, 3: FSDP)
    accumulation_fusion: bool = False   # the wgrad GEMM accumulates into the fp32 main grad
    overlap_dp: bool = False            # gradient buckets reduced during the backward
    overlap_dp_with_pipeline: bool = False
    overlap_tp: bool = False            # TP collectives hidden behind the GEMMs they feed
    async_tp_backward: bool = False     # the column-parallel linears' backward collectives beside their GEMMs
    flash_attention: bool = False       # no s x s scores stored or streamed
    grad_reduce_bytes: int = 2          # bytes per gradient element on the wire
    fp32_main_grads: bool = False       # gradients kept in fp32 (memory)
    schedules: tuple = ("1f1b", "interleaved")
    uneven_stages: bool = False         # first/last stage with fewer layers
    overlap_p2p: bool = False           # interleaved: stage-boundary sends beside the next chunk's compute
    pp_scatter_gather: bool = False     # PP messages sent 1/tp each, all-gathered over TP on arrival
    megatron_optimizer: bool = True     # Megatron's mixed-precision step (optimizer_time.py), not a plain Adam
    fused_kernels: bool = True          # fused scale-mask-softmax and bias-dropout-add (layer_time.py)
    flash_utilization: tuple = ()       # (GPU name prefix, fraction of peak) of its flash-attention kernel

    def attention_utilization(self, gpu) -> float | None:
        """The published fraction of peak its flash-attention kernel reaches on `gpu`, if any."""
        return next((u for prefix, u in self.flash_utilization if gpu.name.startswith(prefix)), None)

    def refusal(self, par) -> str:
        """Why `par` uses a feature this software does not have ('' when it does not)."""
        checks = (
            (par.pp > 1 and not self.pipeline, f"pp{par.pp}: no pipeline parallelism"),
            ((par.virtual > 1 or par.schedule == "interleaved") and not self.interleaving,
             "no interleaved schedule"),
            (par.schedule not in self.schedules, f"no {par.schedule} schedule"),
            (par.sp and not self.sequence_parallel, "no sequence parallelism"),
            (par.recompute not in self.recomputes, f"no {par.recompute} recomputation"),
            (par.cp > 1 and not self.context_parallel, f"cp{par.cp}: no context parallelism"),
            (par.zero not in self.zeros, f"no ZeRO stage {par.zero}"),
            (par.trim and not self.uneven_stages, "no uneven pipeline stages"),
        )
        why = [text for refused, text in checks if refused]
        return f"{self.name} has " + ", ".join(why) if why else ""


SOFTWARE = {s.name: s for s in (
    Software("megatron-2019", "Shoeybi et al. 2019, §3, §5", pipeline=False, interleaving=False,
             schedules=("1f1b",), fused_kernels=False),
    Software("megatron-2021", "Narayanan et al. 2021, §2.2.2, §3.5, §4.1, §5; examples/sc21",
             overlap_dp=True, pp_scatter_gather=True),             # torch's DDP without a pipeline (run_table_1.sh: DDP=torch)
    Software("megatron-2022", "Korthikanti et al. 2022, §4.2.2, §5", sequence_parallel=True,
             recomputes=RECOMPUTES, accumulation_fusion=True, async_tp_backward=True, overlap_dp=True,
             pp_scatter_gather=True),
    Software("megatron-core", "Megatron-Core (NVIDIA/Megatron-LM, core_v0.x)", sequence_parallel=True,
             recomputes=RECOMPUTES, context_parallel=True, zeros=(0, 1, 3), accumulation_fusion=True,
             overlap_dp=True, overlap_dp_with_pipeline=True, overlap_tp=True, async_tp_backward=True,
             flash_attention=True,
             grad_reduce_bytes=4, fp32_main_grads=True, uneven_stages=True, overlap_p2p=True),
    Software("llama3-2024", "Dubey et al. 2024, §3.3.2, §3.3.4", sequence_parallel=True,
             recomputes=("none",), context_parallel=True, zeros=(1,), accumulation_fusion=False,
             overlap_dp=True, overlap_dp_with_pipeline=True, flash_attention=True, grad_reduce_bytes=4,
             fp32_main_grads=True, uneven_stages=True, overlap_p2p=True, megatron_optimizer=False,
             flash_utilization=FLASH_ATTENTION_2),
    Software("minitron", "minitron/train/engine.py", sequence_parallel=True, recomputes=RECOMPUTES,
             context_parallel=True, zeros=(0, 1, 2, 3), accumulation_fusion=True, overlap_dp=True,
             megatron_optimizer=False,
             schedules=("1f1b", "interleaved", "zb-h1", "gpipe")),
)}


def software(name: str) -> Software:
    if name not in SOFTWARE:
        raise ValueError(f"unknown software {name!r}: choose one of {', '.join(SOFTWARE)}, "
                         "e.g. megatron-core")
    return SOFTWARE[name]
