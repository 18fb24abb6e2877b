"""Deliberate errors for testing the verifier: tests/test_verify.py, and the hidden option
`python -m minitron.verify --plant KIND[:parameter]` (a repro from the command line).

Each plant breaks one thing at one point of a step and should be caught by exactly one kind of
row: a replica that drifts on tp rank 1 (grads or weights), an error in one gradient (1%, in
bfloat16 3.9%: grad_error), a 1% error in one tensor's update or in one logit; in the pipeline
executor, a gradient delivered to the wrong stage or a W dropped; in an MoE layer, a wrong split size, an unpermute off by one or a
token sent to the wrong expert, or expert biases updated from one rank's counts; in the FP8 GEMMs (--dtype fp8), a scale never updated from its
amax history or one applied twice.

This file holds the list (PLANTS) and the Plant that puts each in at its point of the step;
the faults themselves sit by the layer they break: plants_pipeline.py, plants_data_parallel.py,
plants_context_parallel.py, plants_tp_overlap.py, plants_moe.py and plants_fp8.py, all patched
in from outside (patching.py).
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..data_parallel.checks import master_pieces
from ..grid import Grid
from ..pipeline import executor
from ..tensor_parallel import overlap
from ..train.step import StepHooks
from .patching import patched
from .plants_context_parallel import merged_without_rescale
from .plants_data_parallel import plant_engine
from .plants_fp8 import BLOCK_PLANTS, install_fp8
from .plants_moe import local_loads, plant_dispatch, wrong_topk
from .plants_pipeline import drops_first_w, passes_back
from .plants_tp_overlap import misfiled

PLANTS = {
    "replica-drift": "after finalize_grads, tp rank 1 halves its norm weights' gradients",
    "weight-drift": "after the step, tp rank 1 moves final_norm.weight up by one float spacing",
    "grad": "one gradient max(1%, 5 eps) off on every rank that holds it (GRAD_ERROR; bfloat16: "
            "3.9%; default layers.0.mlp.fc1.weight, with experts layers.0.mlp.experts.fc1.weight)",
    "update": "one tensor's update 1% too large on every rank that holds it (default as grad; "
              "in 16 bits its fp32 master's: the weight the optimizer steps)",
    "fp16-unscaled-loss": "float16: the split side's loss is not scaled (scale 1 where the reference "
                          "scales by 1024), so its small gradients underflow",
    "logit": "the largest logit 1% off (the compared copy)",
    "pp-wrong-stage": "pipeline: a stage passes back the gradient it received (dL/d its output) "
                      "instead of dL/d its input, so the gradient reaches the wrong stage",
    "pp-drop-w": "pipeline: the W of micro-batch 0 on stage 0 is dropped (its dL/dW never runs)",
    "pp-stale-grad": "pipeline: a stage passes back, for each micro-batch, the gradient it passed "
                     "back for the previous one (zeros for the first): a reused buffer",
    "dp-bucket": "data parallel (--zero 0): bucket 1 of the gradient buffer is never all-reduced "
                 "(each rank keeps its own gradient, times 1/dp)",
    "zero-gather": "ZeRO 1/2: the updated shards are never all-gathered (each rank keeps only the "
                   "update of the shard it owns); ZeRO-3: a unit's gather refreshes only this "
                   "rank's shard, the others' pieces stay as first gathered",
    "hsdp-no-replicate": "hybrid sharding (dp_shard < dp): the gradient shards are never "
                         "all-reduced across dp_replicate (each copy keeps its shard group's sum)",
    "cp-no-rescale": "context parallel: attention blocks summed as they come, without the "
                     "exp(lse_block - lse) rescale",
    "cp-chunk-order": "context parallel: the batch cut into contiguous chunks while positions, "
                      "masks and the gather back assume zigzag (a wrong chunk order)",
    "moe-split": "experts: the grouped matmul's split sizes are off: one row of each rank's first "
                 "local expert is run by the next (minitron/moe/dispatch.py)",
    "tp-overlap-chunk": "--tp-comm-overlap: the ring all-gather files each chunk it receives "
                        "under the wrong rank (minitron/tensor_parallel/overlap.py)",
    "moe-unpermute": "experts: the expert outputs are off by one row when the regrouping is "
                     "undone, so they return to the wrong tokens",
    "moe-topk": "experts: each rank's router gives its first token the expert it scores lowest "
                "as its first choice (its own top-k, judged against the reference's scores)",
    "moe-route": "experts: each rank sends its first token's first choice to an expert the router "
                 "did not choose (a token sent to the wrong expert)",
    "moe-local-load": "--balance aux-free: each rank updates its expert biases from its own tokens' "
                      "counts, not those summed over the ranks holding the batch's other tokens",
    "fp8-stale-amax": "FP8, delayed scaling: the amax history holds a stale amax of 1.0 and is never "
                      "updated, so a norm's output (amax 3-4) saturates: clipped to +-1",
    "fp8-double-scale": "FP8: each GEMM's output divides out the weight's scale twice (y / (s_x s_w^2))",
    "fp8-unscaled": "FP8: scaling switched off, every scale 1 (small weights and gradients underflow)",
    "fp8-e5m2-forward": "FP8: the forward's inputs and weights in E5M2 instead of E4M3, scaled to "
                        "E5M2's range (Transformer Engine's Format.E5M2 everywhere): a bit fewer",
    "fp8-wrong-amax": "FP8: each GEMM casts its input with the scale of its weight's amax (an amax "
                      "taken from the wrong tensor: the input saturates)",
    "fp8-experts-unscaled": "FP8 with experts: the experts' GEMMs cast with scale 1 (the dense "
                            "layers' stay right): their small weights and gradients underflow",
    "fp8-experts-e5m2-forward": "FP8 with experts: the experts' forward casts to E5M2 instead of "
                                "E4M3 (the dense layers' stay right): one mantissa bit fewer",
    "fp8-block-per-tensor": "FP8 blockwise / mxfp8: one scale for each rank's whole tensor (448 / "
                            "its amax) instead of one per block",
    "fp8-mx-scale-not-pow2": "FP8 mxfp8: each block's scale 448 / amax, not the power of two of "
                             "the E8M0 scale (floor(log2 amax) - 8)",
    "fp8-block-wrong-dim": "FP8 blockwise / mxfp8: the inputs' and gradients' tiles along the "
                           "GEMM's M or N instead of along K (128x1 for 1x128)",
}


def grad_error(dtype: torch.dtype) -> float:
    """The plant grad's relative error: 1%, or 5 roundings of the gradient's dtype where 1% is
    less (bfloat16, eps = 2^-7: 3.9%; float16 and float32 keep 1%). A plant stands for a
    systematic error, one a verdict must tell from rounding. In bfloat16 1% is 1.3 spacings of
    the stored gradient: along the reference it reaches z = 16-25 noise units, where correct
    splits reach 3.0 at the same shape (3.9 in the matrix; noise_rows.C_ALONG), so no bar fails
    it and passes them both by 3x (the best, 2.3x; C_ALONG = 15 fails it by 1.1x). At 5 eps it
    fails by 4x or more (tools/verdict_margins.py, seeds 0-3)."""
    return max(0.01, 5 * torch.finfo(dtype).eps)


class Plant(StepHooks):
    """`kind[:parameter]`, one of PLANTS: a deliberate error at one point of the step."""

    def __init__(self, spec: str | None):
        self.kind, _, target = (spec or "").partition(":")
        if self.kind and self.kind not in PLANTS:
            raise ValueError(f"unknown plant {self.kind!r}: choose one of {sorted(PLANTS)}")
        defaults = {"replica-drift": "norm.weight", "weight-drift": "final_norm.weight"}
        self.target = target or defaults.get(self.kind, "layers.0.mlp.fc1.weight")
        self._chosen = bool(target) or self.kind in defaults
        self._before: torch.Tensor | None = None
        self._sent: dict[int, torch.Tensor] = {}     # pp-stale-grad: stage -> last gradient sent

    def resolve(self, reference) -> "Plant":
        """Check the target against the one-device model, which holds every parameter: a rank
        of a split may hold none of it (another pipeline stage). An MoE layer's MLP is its
        experts, so grad and update default to the first layer's experts there."""
        names = [n for n, _ in reference.named_parameters()]
        if not self._chosen and reference.cfg.n_experts:
            self.target = "layers.0.mlp.experts.fc1.weight"
        if not any(n.endswith(self.target) for n in names):
            raise ValueError(f"plant {self.kind}: no parameter named *{self.target}; "
                             f"one that exists: {names[len(names) // 2]}")
        return self

    def _params(self, model) -> list[torch.nn.Parameter]:
        """This rank's pieces of the target (none on a stage that holds another layer)."""
        return [p for n, p in model.named_parameters() if n.endswith(self.target)]

    def install(self, model) -> None:
        """Put a dispatch fault into every MoE layer of `model` (moe-* plants) or a scaling fault
        into every FP8 layer (fp8-* plants): the model's own objects are patched, so the fault
        ends with the model (a pool's ranks outlive one run)."""
        if self.kind == "tp-overlap-chunk" and not model.grid.tp_comm_overlap:
            raise ValueError("plant tp-overlap-chunk needs --tp-comm-overlap (with --sp)")
        if self.kind.startswith("fp8-experts-") and not model.cfg.n_experts:
            raise ValueError(f"plant {self.kind} needs a model with experts (--experts)")
        if self.kind.startswith("fp8-"):
            return install_fp8(self.kind, model)
        if not self.kind.startswith("moe-"):
            return
        if self.kind in ("moe-local-load", "moe-topk"):
            self.check_model(model.cfg)
            return
        layers = [m for m in model.modules() if hasattr(m, "dispatcher")]
        if not layers:
            raise ValueError(f"plant {self.kind} needs a model with experts (--experts)")
        for m in layers:
            plant_dispatch(m, self.kind[len("moe-"):])

    def step(self):
        """The faults in functions every model shares (ring attention's merge, the overlapped
        ring all-gather, the pipeline executor's backward and W), patched for the step only."""
        stack = contextlib.ExitStack()
        if self.kind == "cp-no-rescale":
            stack.enter_context(merged_without_rescale())
        elif self.kind == "tp-overlap-chunk":
            stack.enter_context(patched(overlap, "ring_gather", misfiled(overlap.ring_gather)))
        elif self.kind in ("pp-wrong-stage", "pp-stale-grad"):
            stack.enter_context(patched(executor._Run, "backward",
                                         passes_back(executor._Run.backward, self.kind, self._sent)))
        elif self.kind == "moe-topk":
            stack.enter_context(wrong_topk())
        elif self.kind == "pp-drop-w":
            stack.enter_context(patched(executor._Run, "weights", drops_first_w(executor._Run.weights)))
        return stack

    def check_model(self, cfg) -> "Plant":
        """Refuse a plant the model cannot hold (cli.py asks before any rank starts)."""
        if self.kind == "moe-topk" and not cfg.n_experts:
            raise ValueError("plant moe-topk needs a model with experts (--experts)")
        if self.kind == "moe-local-load" and not (cfg.n_experts and cfg.expert_bias):
            raise ValueError("plant moe-local-load needs expert biases: add --balance aux-free")
        return self

    def check_fp8(self, recipe) -> "Plant":
        """Refuse an fp8-* plant the run cannot hold (before any rank starts)."""
        if self.kind.startswith("fp8-") and recipe is None:
            raise ValueError(f"plant {self.kind} needs FP8 layers: add --dtype fp8")
        if self.kind == "fp8-stale-amax" and recipe.scaling != "delayed":
            raise ValueError("plant fp8-stale-amax breaks the amax history, which only delayed "
                             "scaling keeps: use --fp8-recipe delayed")
        if self.kind in BLOCK_PLANTS and not recipe.fine_grained:
            raise ValueError(f"plant {self.kind} breaks the scales of blocks: use --fp8-recipe "
                             f"{'mxfp8' if 'mx' in self.kind else 'blockwise'}")
        if self.kind == "fp8-mx-scale-not-pow2" and recipe.scaling != "mxfp8":
            raise ValueError("plant fp8-mx-scale-not-pow2 breaks the power-of-two scales of "
                             "mxfp8: use --fp8-recipe mxfp8")
        if self.kind.startswith("fp8-") and not self.kind.startswith("fp8-experts-") \
                and self.kind not in BLOCK_PLANTS and recipe.fine_grained:
            raise ValueError(f"plant {self.kind} breaks a per-tensor scale, and {recipe.scaling} "
                             "has one per block: use --fp8-recipe current")
        return self

    def _on_rank_1(self, grid: Grid) -> bool:
        if grid.tp.size < 2:
            raise ValueError(f"plant {self.kind} drifts tp rank 1 from rank 0: needs tp >= 2")
        return grid.tp.rank == 1

    @torch.no_grad()
    def grads(self, model, grid: Grid) -> None:
        if self.kind == "replica-drift" and self._on_rank_1(grid):
            for p in self._params(model):
                p.grad.mul_(0.5)
        elif self.kind == "grad":
            for p in self._params(model):
                if p.grad is not None:          # ZeRO 2/3 keep no whole .grad
                    p.grad.mul_(1 + grad_error(p.grad.dtype))

    @torch.no_grad()
    def logits(self, full: torch.Tensor) -> torch.Tensor:
        if self.kind != "logit":
            return full
        full = full.clone(memory_format=torch.contiguous_format)
        i = full.abs().argmax()
        full.view(-1)[i] *= 1.01
        return full

    # ---- context-parallel faults (verify asks) ----
    def cp_layout(self) -> str:
        """The chunk order the batch is cut in (the model always assumes zigzag)."""
        return "contiguous" if self.kind == "cp-chunk-order" else "zigzag"

    # ---- data-parallel engine faults (steps.py asks, once the engine is built) ----
    def engine(self, engine) -> None:
        plant_engine(self.kind, engine)

    def loss_scale(self, scale: float) -> float:
        """The split side's fixed float16 loss scale (the reference keeps `scale`)."""
        return 1.0 if self.kind == "fp16-unscaled-loss" else scale

    def _stepped(self, model, run) -> list[torch.Tensor]:
        """What the optimizer steps for the target: the weight, or in a 16-bit run the pieces
        of its fp32 master this rank owns."""
        held = self._params(model)
        if not held:
            return []
        p = held[0]
        opt = getattr(run, "optimizer", None) if run is not None and run.engine is not None else None
        if opt is None or opt.master_is_model:
            return [p]
        return [v for _, v in master_pieces(run.engine, opt.master, p)]

    def before_step(self, model, run=None) -> None:
        if self.kind == "moe-local-load":       # the bias update ends the optimizer step
            self._local = local_loads()
            self._local.__enter__()
        if self.kind == "update":
            self._before = [t.detach().clone() for t in self._stepped(model, run)]

    @torch.no_grad()
    def after_step(self, model, grid: Grid, run=None) -> None:
        if self.kind == "moe-local-load":
            self._local.__exit__(None, None, None)
        if self.kind == "update":
            for t, before in zip(self._stepped(model, run), self._before):
                t.copy_(before + 1.01 * (t - before))
        elif self.kind == "weight-drift" and self._on_rank_1(grid):
            for p in self._params(model):
                p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
