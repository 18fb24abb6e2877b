"""Deliberate errors for testing the verifier: tests/test_verify.py, and the hidden option
`python -m minitron.verify --plant KIND[:parameter]` (a repro from the command line).

Each plant breaks one thing at one point of a step and should be caught by exactly one kind of
row: a replica that drifts on tp rank 1 (grads or weights), a 1% error in one gradient, in one
tensor's update, or in one logit; in the pipeline executor, a gradient delivered to the wrong
stage or a W dropped; in an MoE layer, a wrong split size, an unpermute off by one or a
token sent to the wrong expert; in the FP8 GEMMs (--dtype fp8), a scale never updated from its
amax history or one applied twice.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..context_parallel.blocks import Accumulator
from ..data_parallel.checks import master_pieces
from ..data_parallel.zero3 import ZeroStage3
from ..grid import Grid
from ..pipeline import executor
from ..runtime.comm_async import Pending
from ..tensor_parallel import overlap, weight_grad
from ..tensor_parallel.fp8 import E4M3, delayed_scale, scale_from_amax
from ..tensor_parallel.fp8_linear import fp8_states
from ..train.step import StepHooks

PLANTS = {
    "replica-drift": "after finalize_grads, tp rank 1 halves its norm weights' gradients",
    "weight-drift": "after the step, tp rank 1 moves final_norm.weight up by one float spacing",
    "grad": "one gradient 1% off on every rank (default layers.0.mlp.fc1.weight)",
    "update": "one tensor's update 1% too large on every rank (default layers.0.mlp.fc1.weight; "
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
    "moe-route": "experts: each rank sends its first token's first choice to an expert the router "
                 "did not choose (a token sent to the wrong expert)",
    "fp8-stale-amax": "FP8, delayed scaling: the amax history holds a stale amax of 1.0 and is never "
                      "updated, so a norm's output (amax 3-4) saturates: clipped to +-1",
    "fp8-double-scale": "FP8: each GEMM's output divides out the weight's scale twice (y / (s_x s_w^2))",
    "fp8-unscaled": "FP8: scaling switched off, every scale 1 (small weights and gradients underflow)",
    "fp8-e5m2-forward": "FP8: the forward's inputs and weights in E5M2 instead of E4M3, scaled to "
                        "E5M2's range (Transformer Engine's Format.E5M2 everywhere): a bit fewer",
    "fp8-wrong-amax": "FP8: each GEMM casts its input with the scale of its weight's amax (an amax "
                      "taken from the wrong tensor: the input saturates)",
}


def _stale_gather(unit):
    """unit.gather that keeps its first result but for this rank's own shard (zero-gather)."""
    real, first = unit.gather, []

    @torch.no_grad()
    def gather():
        if unit.gathered:
            return
        real()
        if not first:
            first.append(unit.full.clone())
        lo, hi = unit.range
        unit.full.copy_(first[0])
        unit.full[lo:hi].copy_(unit.shard)
    return gather


class Plant(StepHooks):
    """`kind[:parameter]`, one of PLANTS: a deliberate error at one point of the step."""

    def __init__(self, spec: str | None):
        self.kind, _, target = (spec or "").partition(":")
        if self.kind and self.kind not in PLANTS:
            raise ValueError(f"unknown plant {self.kind!r}: choose one of {sorted(PLANTS)}")
        defaults = {"replica-drift": "norm.weight", "weight-drift": "final_norm.weight"}
        self.target = target or defaults.get(self.kind, "layers.0.mlp.fc1.weight")
        self._before: torch.Tensor | None = None
        self._sent: dict[int, torch.Tensor] = {}     # pp-stale-grad: stage -> last gradient sent

    def _params(self, model) -> list[torch.nn.Parameter]:
        found = [p for n, p in model.named_parameters() if n.endswith(self.target)]
        if not found:
            raise ValueError(f"plant {self.kind}: no parameter named *{self.target}")
        return found

    def install(self, model) -> None:
        """Put a dispatch fault into every MoE layer of `model` (moe-* plants) or a scaling fault
        into every FP8 layer (fp8-* plants): the model's own objects are patched, so the fault
        ends with the model (a pool's ranks outlive one run)."""
        if self.kind == "tp-overlap-chunk" and not model.grid.tp_comm_overlap:
            raise ValueError("plant tp-overlap-chunk needs --tp-comm-overlap (with --sp)")
        if self.kind.startswith("fp8-"):
            return self._install_fp8(model)
        if not self.kind.startswith("moe-"):
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
            stack.enter_context(patched(overlap, "ring_gather", _misfiled(overlap.ring_gather)))
        elif self.kind in ("pp-wrong-stage", "pp-stale-grad"):
            stack.enter_context(patched(executor._Run, "backward",
                                         self._passes_back(executor._Run.backward)))
        elif self.kind == "pp-drop-w":
            stack.enter_context(patched(executor._Run, "weights", _drops_first_w(executor._Run.weights)))
        return stack

    def check_fp8(self, recipe) -> "Plant":
        """Refuse an fp8-* plant the run cannot hold (before any rank starts)."""
        if self.kind.startswith("fp8-") and recipe is None:
            raise ValueError(f"plant {self.kind} needs FP8 layers: add --dtype fp8")
        if self.kind == "fp8-stale-amax" and recipe.scaling != "delayed":
            raise ValueError("plant fp8-stale-amax breaks the amax history, which only delayed "
                             "scaling keeps: use --fp8-recipe delayed")
        return self

    def _install_fp8(self, model) -> None:
        for state in fp8_states(model):
            if self.kind == "fp8-double-scale":
                _divide_weight_scale_twice(state)
            elif self.kind == "fp8-unscaled":
                for scaler in state.scalers():
                    scaler._scale_for = lambda x: torch.ones((), device=x.device)
            elif self.kind == "fp8-e5m2-forward":
                _cast_forward_to_e5m2(state)
            elif self.kind == "fp8-wrong-amax":
                _input_scaled_by_weight(state)
            else:
                for scaler in state.scalers():
                    _hold_stale_amax(scaler, 1.0)

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
                    p.grad.mul_(1.01)

    @torch.no_grad()
    def logits(self, full: torch.Tensor) -> torch.Tensor:
        if self.kind != "logit":
            return full
        full = full.clone(memory_format=torch.contiguous_format)
        i = full.abs().argmax()
        full.view(-1)[i] *= 1.01
        return full

    # ---- pipeline executor faults ----
    def _grad_in(self, grad_in: torch.Tensor, grad_out: torch.Tensor | None,
                 stage: int) -> torch.Tensor:
        """What stage `stage` passes back instead of dL/d(input): under pp-wrong-stage the
        gradient of its output it was given (a middle stage only: the last stage's is the loss),
        under pp-stale-grad the one it passed back for the previous micro-batch."""
        if self.kind == "pp-wrong-stage":
            return grad_in if grad_out is None else grad_out
        sent = self._sent.get(stage)
        self._sent[stage] = grad_in.detach().clone()
        return torch.zeros_like(grad_in) if sent is None else sent

    def _passes_back(self, backward):
        """executor._Run.backward, then what it left to pass back replaced (_grad_in)."""
        def planted(run, mb: int, s: int, defer: bool) -> None:
            grad_out = None if s == run.last else run.grad_out.get((mb, s))
            backward(run, mb, s, defer)
            if s == 0:
                return
            here = run._local(s - 1)          # the previous stage on this rank, or sent to it
            store, key = (run.grad_out, (mb, s - 1)) if here else (run.grad_in, (mb, s))
            store[key] = self._grad_in(store[key], grad_out, s)
        return planted

    # ---- context-parallel faults (verify asks) ----
    def cp_layout(self) -> str:
        """The chunk order the batch is cut in (the model always assumes zigzag)."""
        return "contiguous" if self.kind == "cp-chunk-order" else "zigzag"

    # ---- data-parallel engine faults (steps.py asks, once the engine is built) ----
    def engine(self, engine) -> None:
        if self.kind == "dp-bucket":
            _never_reduce_bucket(engine, 1)
        elif self.kind == "hsdp-no-replicate":
            if engine.replicas.size == 1:
                raise ValueError("plant hsdp-no-replicate skips the all-reduce across replicas: "
                                 "needs --dp-shard below --dp (and --zero 1, 2 or 3)")
            engine.sync_replicas = lambda shard: None
        elif self.kind == "zero-gather":
            if isinstance(engine, ZeroStage3):
                for unit in engine.units:
                    unit.gather = _stale_gather(unit)
            elif engine.zero_stage not in (1, 2):
                raise ValueError("plant zero-gather skips ZeRO's all-gather of updated weights: "
                                 "use --zero 1, 2 or 3")
            else:
                engine.after_step = lambda: None

    def loss_scale(self, scale: float) -> float:
        """The split side's fixed float16 loss scale (the reference keeps `scale`)."""
        return 1.0 if self.kind == "fp16-unscaled-loss" else scale

    def _stepped(self, model, run) -> list[torch.Tensor]:
        """What the optimizer steps for the target: the weight, or in a 16-bit run the pieces
        of its fp32 master this rank owns."""
        p = self._params(model)[0]
        opt = getattr(run, "optimizer", None) if run is not None and run.engine is not None else None
        if opt is None or opt.master_is_model:
            return [p]
        return [v for _, v in master_pieces(run.engine, opt.master, p)]

    def before_step(self, model, run=None) -> None:
        if self.kind == "update":
            self._before = [t.detach().clone() for t in self._stepped(model, run)]

    @torch.no_grad()
    def after_step(self, model, grid: Grid, run=None) -> None:
        if self.kind == "update":
            for t, before in zip(self._stepped(model, run), self._before):
                t.copy_(before + 1.01 * (t - before))
        elif self.kind == "weight-drift" and self._on_rank_1(grid):
            for p in self._params(model):
                p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))


@contextlib.contextmanager
def merged_without_rescale():
    """Inside the block, context_parallel.blocks.Accumulator sums the blocks' outputs as they
    come, without the exp(lse_block - lse) rescale of the online softmax (a planted bug)."""
    def unscaled(self, rows, out_b, lse_b):
        lse = self.lse[:, :, rows]
        self.out[:, :, rows].add_(out_b)
        lse.copy_(torch.logaddexp(lse, lse_b.to(lse.dtype)))
    merge, Accumulator.merge = Accumulator.merge, unscaled
    try:
        yield
    finally:
        Accumulator.merge = merge


def _never_reduce_bucket(engine, b: int) -> None:
    """Bucket b's all-reduce is replaced by nothing: its gradients stay this rank's (times 1/dp)."""
    gb = engine.buffers[0]
    if getattr(engine, "zero_stage", 3) != 0 or len(gb.layout.buckets) <= b:
        raise ValueError(f"plant dp-bucket needs plain data parallelism (--zero 0) and more than {b} "
                         f"buckets")
    launch = gb.launch

    def launch_all_but_b(k: int) -> None:
        if k != b:
            return launch(k)
        bucket = gb.layout.buckets[k]
        data = gb.grads_flat[bucket.start:bucket.end].mul_(gb.scale)
        gb.pending[k] = Pending("all_reduce", gb.group, None, data)   # done at once: nothing sent
    gb.launch = launch_all_but_b


def _hold_stale_amax(scaler, stale: float) -> None:
    """fp8-stale-amax: the scaler's amax history holds `stale`, recorded before, and is never
    written again, so every scale comes from it (max / stale), whatever the tensor's amax."""
    def scale_for(x: torch.Tensor) -> torch.Tensor:
        scaler.history = torch.full((scaler.recipe.history_len,), stale, device=x.device)
        return delayed_scale(scaler.history, scaler.fmt, scaler.recipe.margin)
    scaler._scale_for = scale_for


def _cast_forward_to_e5m2(state) -> None:
    """fp8-e5m2-forward: the input's and weight's scalers take E5M2's range, and while the
    layer's forward runs its E4M3 casts are E5M2 casts."""
    from ..tensor_parallel import fp8_linear
    linear = state.linear
    state.input.fmt = state.weight.fmt = fp8_linear.E5M2

    def planted(x, weight, bias):
        with patched(fp8_linear, "E4M3", fp8_linear.E5M2):
            return linear(x, weight, bias)
    state.linear = planted


def _input_scaled_by_weight(state) -> None:
    """fp8-wrong-amax: the input's scale comes from the weight's amax (reduced as the weight's)."""
    linear = state.linear

    def planted(x, weight, bias):
        state.input._scale_for = lambda _x: scale_from_amax(state.weight.amax_of(weight), E4M3,
                                                             state.recipe.margin)
        return linear(x, weight, bias)
    state.linear = planted


class _DividedOnceMore(torch.autograd.Function):
    """Forward: y / s (rounded to y's dtype); backward: the gradient passes to y unchanged, so
    the fault is in the forward GEMM's output alone, as a wrong rescale inside it would be."""
    @staticmethod
    def forward(ctx, y, s):
        return (y.float() / s).to(y.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _divide_weight_scale_twice(state) -> None:
    """fp8-double-scale: the layer's forward GEMM divides out the weight's scale twice,
    y = (q_x q_w^T) / (s_x s_w^2); the backward's GEMMs stay right."""
    weight_scale_for, linear, used = state.weight._scale_for, state.linear, []

    def recorded(w: torch.Tensor) -> torch.Tensor:
        used.append(weight_scale_for(w))
        return used[-1]

    def planted(x, weight, bias):
        used.clear()
        y = _DividedOnceMore.apply(linear(x, weight, None), used[-1])
        return y + bias if bias is not None else y
    state.weight._scale_for, state.linear = recorded, planted


@contextlib.contextmanager
def patched(owner, name: str, value):
    """owner.name = value inside the block, the original back after it."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _misfiled(ring_gather):
    """tp-overlap-chunk: overlap.ring_gather that files each chunk under the rank before the one
    that sent it (compute(j - 1, x_j) instead of compute(j, x_j))."""
    def planted(x, group, compute, what):
        return ring_gather(x, group, lambda j, x_j: compute((j - 1) % group.size, x_j), what)
    return planted


def _drops_first_w(weights):
    """pp-drop-w: executor._Run.weights that drops the W of micro-batch 0 on stage 0."""
    def planted(run, mb: int, s: int) -> None:
        if (mb, s) == (0, 0):
            weight_grad.STORE.queues.pop((mb, s), None)
            return
        weights(run, mb, s)
    return planted


def plant_dispatch(layer, kind: str) -> None:
    """One MoE layer's dispatch with a fault, its code untouched: the layer's dispatcher is
    wrapped. "route": the first token's first choice goes to an expert the router did not
    choose; "split": the grouped matmul runs one row of the first local expert with the next;
    "unpermute": the expert outputs, in grouped order, are off by one row when the regrouping
    is undone, so they return to the wrong tokens."""
    if kind not in ("route", "split", "unpermute"):
        raise ValueError(f"unknown dispatch fault {kind!r}: route, split or unpermute")
    dispatch, n_experts = layer.dispatcher, layer.cfg.n_experts

    def planted(x, r, experts):
        if kind == "route":
            if x.shape[0]:
                r.experts = _misroute_first_token(r.experts, n_experts)
            return dispatch(x, r, experts)

        def faulty(rows, counts, bias_rows):
            if kind == "unpermute":
                return experts(rows, counts, bias_rows).roll(1, 0)
            if len(counts) > 1 and counts[0] > 0:                      # split
                counts = [counts[0] - 1, counts[1] + 1, *counts[2:]]
            return experts(rows, counts, bias_rows)
        return dispatch(x, r, faulty)
    layer.dispatcher = planted


def _misroute_first_token(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Token 0's first choice replaced by the lowest expert it did not choose."""
    wrong = experts.clone()
    wrong[0, 0] = min(set(range(n_experts)) - set(experts[0].tolist()))
    return wrong
