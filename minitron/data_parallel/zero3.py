"""ZeRO stage 3: the parameters themselves sharded over dp, each unit gathered when it is needed.

    engine = ZeroStage3(model, grid)          # units: default_units(model), one per layer
    opt = ZeroOptimizer(engine, lr=1e-4)      # zero.py: AdamW on this rank's shard
    engine.zero_grad(); loss.backward(); engine.finish_grad_sync(); opt.step()

ZeroStage3's docstring says when a unit is gathered, freed and reduce-scattered, how
micro-batches accumulate (and what that costs in memory and traffic), and how pipelines and
B/W-split schedules fit in. zero3_units.py says which parameters form a unit, zero3_shard.py
holds one unit's shard and gathers, frees and reduce-scatters it; this file hooks them in.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..runtime import comm
from ..grid import Grid
from ..tensor_parallel import weight_grad
from .ddp import reduction_group, sum_sequence_parallel_grads
from .engine_api import GradientEngine, Piece
from .zero3_shard import _FreeAfterBackward, _Unit
from .zero3_units import _kind, default_units, split_units


class ZeroStage3(GradientEngine):
    """Parameters, gradients and optimizer state all sharded over the data-parallel group.

    Each unit (default_units: one per layer, plus embedding, final norm, output layer) is
    gathered just before its forward and freed right after; gathered again when backward
    reaches it (a hook on its output's gradient) and freed once backward has left it (an
    identity on its input whose backward frees it; the embedding, whose input is tokens, when
    its gradients are in). Every forward and every backward gathers anew, so with m
    micro-batches a unit is gathered 2m times per step, always from the same shard (the
    optimizer only writes it after the step): every micro-batch sees the same weights.

    Experts: an MoE layer's expert weights are summed over dp_cp, the ranks that hold the same
    experts (ddp.py), not dense_dp; so they form a unit of their own (split_units), sharded
    over dp_cp and gathered around the experts' forward and backward inside the layer's unit
    (split_units),
    whose dense weights are sharded over dense_dp as usual. Both are averaged by 1/dense_dp, as
    in DataParallel, and per micro-batch each costs 3 (N-1)/N of its bytes over its own group
    (N = dense_dp or dp_cp). Megatron-Core's distributed optimizer shards expert state over its
    expert-data-parallel group the same way.

    Hybrid sharding (HSDP, grid.dp_shard < dp): units are sharded over dense_dp_shard only, so
    every gather and reduce-scatter stays inside it; the micro-batches' sum in the gradient
    shard is then all-reduced once across dp_replicate (finish_grad_sync), 1/dp_shard of the
    gradient crossing the slow links once per step instead of every weight 2m times.

    Gradient accumulation, DeepSpeed's way: a unit's gradients are reduce-scattered into this
    rank's gradient shard as soon as a micro-batch's last one is in, and .grad is freed; the
    micro-batches add up in the shard. So gradients stay sharded (2Ψ/N, plus one unit's
    full .grad at a time; under B/W split also the norms' gradients of B's whose W has not run)
    and each micro-batch costs 2 all-gathers and 1 reduce-scatter:

        wire bytes per rank per step = 3m (N-1)/N * bytes(Ψ)     (m micro-batches)

    against (2m+1) (N-1)/N * bytes(Ψ) for keeping the whole .grad until the last micro-batch
    (one reduce-scatter, but 2Ψ of full gradients alive all step: ZeRO-2's memory). no_sync()
    is therefore a no-op: there is nothing to hold back.

    Tied embeddings (pp = 1): the word embedding has one owner, the embedding unit, and two
    uses, the lookup and the output layer. That unit is "held": gathered by the lookup's
    forward, freed only once its gradients are reduce-scattered. Autograd sums both uses'
    gradients into the one .grad before the post-accumulate hook fires, so one reduce-scatter
    sends their sum. The price: the V/tp x h table stays whole through the micro-batch; it is
    gathered once per micro-batch, not twice (tests/test_zero3_tied.py counts the bytes).

    Tied embeddings across pipeline stages (PipelineGPT.tied_across_ranks): the first stage's
    word embedding and the last stage's copy (marked shared_embedding) are each a unit of their
    own (split_units), the same single tensor in the same layout, so the two ranks keep the same
    elements; each is gathered around its one use (the lookup; the copy's forward, which is the
    output layer) like any unit. finish_grad_sync then sums the two gradient shards over
    grid.embedding, Megatron's _allreduce_word_embedding_grads on 1/N of the bytes, and both
    copies take the same step. With the first and last stage on one rank (ZB-V, DualPipeV) the
    one weight's two uses interleave across micro-batches, which a held unit cannot follow:
    refused (minitron/refusals/).

    Pipelines (PipelineGPT: only this rank's stages; one unit per layer it holds) need nothing
    more: a stage runs its units' forwards m times and their backwards m times, each with its
    own gather. B/W-split schedules (zero bubble, tensor_parallel/weight_grad.py): B needs the
    weights (dL/dX = dL/dY W) and gathers them like any backward; W needs only the saved
    activations and output gradients, so it runs on freed weights and accumulates into .grad,
    calling weight_grad's hook. A micro-batch of a unit is complete when every parameter has
    one more contribution than was reduce-scattered (a counter per parameter, fed by autograd's
    post-accumulate hooks and weight_grad's; a deferred parameter's empty autograd call in B is
    skipped): the W of a unit's micro-batch triggers its reduce-scatter. What .grad holds then
    may include the next micro-batch's norm gradients (from its B): sums are sums, each
    contribution is sent exactly once, and m reduce-scatters per unit still hold.
    """

    zero_stage = 3
    grads_replicated = False

    def __init__(self, model: nn.Module, grid: Grid, units: list[nn.Module] | None = None):
        self.model, self.grid = model, grid
        units = [piece for m in (units if units is not None else default_units(model))
                 for piece in split_units(m)]
        self.names = {p: n for n, p in model.named_parameters()}
        owned = [p for _, ps in units for p in ps]
        wanted = [p for p in model.parameters() if p.requires_grad]
        if len(owned) != len(set(owned)) or set(owned) != set(wanted):
            raise ValueError("ZeroStage3 units must hold every trainable parameter exactly once: "
                             f"{len(set(wanted) - set(owned))} left out, "
                             f"{len(owned) - len(set(owned))} in two units")
        self.group, self.replicas = grid.dense_dp_shard, grid.dp_replicate   # HSDP: see below
        self.scale = 1.0 / grid.dense_dp.size
        groups = [reduction_group(ps[0], grid) for _, ps in units]   # dense_dp or dp_cp (shards)
        self.units = [_Unit(m, ps, g, g.rank) for (m, ps), g in zip(units, groups)]
        # All shards end to end in one tensor (and the gradient shards in another), so the
        # optimizer steps them as one flat tensor, as it does a DataParallel bucket.
        self.shards = torch.cat([u.shard for u in self.units])
        self.grad_shards = torch.zeros_like(self.shards)
        offset = 0
        for u in self.units:
            n = u.shard.numel()
            u.shard, u.grad_shard = self.shards[offset:offset + n], self.grad_shards[offset:offset + n]
            offset += n
            if not u.sharded:
                u.share_shard()
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.tied = [u for u in self.units if _kind(u.params[0]) == "tied"]   # across stages
        if getattr(model.cfg, "tie_embeddings", False) and not getattr(model, "tied_across_ranks", False):
            if getattr(model, "n_stages", 1) > 1:    # one rank, two stages: see the class doc
                raise ValueError("ZeroStage3 holds a tied embedding gathered from the lookup to its "
                                 "reduce, which two stages on one rank interleave: untie it")
            self.unit_of[model.embedding.word.weight].held = True
        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._before_forward(u, args)))
            self._hooks.append(u.module.register_forward_hook(
                lambda m, a, out, u=u: self._after_forward(u, out)))
        for p in wanted:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            self._hooks.append(weight_grad.register_grad_hook(
                p, lambda p: self.unit_of[p].contribute(p, self.scale)))

    def _before_forward(self, unit: _Unit, args: tuple):
        unit.gather()
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad \
                or not torch.is_grad_enabled():
            return None
        return (_FreeAfterBackward.apply(unit, args[0]), *args[1:])

    def _after_forward(self, unit: _Unit, out) -> None:
        unit.free()

        def gather_for_backward(grad):
            # The output's gradient is ready, so the unit's backward runs next: it needs the
            # weights back. Returning None passes the gradient on unchanged.
            unit.gather()

        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(gather_for_backward)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if weight_grad.waiting(p):            # a B deferred this gradient: W will bring it
            return
        self.unit_of[p].contribute(p, self.scale)

    # ---- GradientEngine (engine_api.py) ------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Nothing to hold back: micro-batches accumulate in the sharded gradient (class doc)."""
        yield

    def finish_grad_sync(self) -> None:
        for u in self.units:
            if any(p.grad is not None for p in u.params):   # a parameter that got no gradient
                u.reduce_grads(self.scale)
            u.free(force=True)
            u.reset()
        for u in self.tied:                   # both copies' gradients: first + last stage
            comm.all_reduce(u.grad_shard, self.grid.embedding)
        self.sync_replicas(self.grad_shards)
        sum_sequence_parallel_grads(self, self.grid)

    def sync_replicas(self, shard: torch.Tensor) -> None:
        """HSDP: sum the gradient shards across the copies of this shard (in place, one call)."""
        comm.all_reduce(shard, self.replicas)

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard.zero_()
            u.reset()

    def owned_params(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units]

    def owned_grads(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    def group_of(self, p: nn.Parameter) -> comm.Group:
        return self.unit_of[p].group

    def grad_pieces(self, p: nn.Parameter) -> list[Piece]:
        u = self.unit_of[p]
        return [(i, u.grad_shard[j:j + ln]) for i, j, ln in u.layout.pieces(p, [u.range])]

    def param_pieces(self, p: nn.Parameter) -> list[Piece]:
        """Only ZeRO-3 shards parameters: the pieces of p this rank keeps (grad_pieces' twin)."""
        u = self.unit_of[p]
        return [(i, u.shard[j:j + ln]) for i, j, ln in u.layout.pieces(p, [u.range])]

    @property
    def parameters(self) -> list[nn.Parameter]:
        return list(self.unit_of)

    def after_step(self) -> None:
        """Nothing to gather: the next forward gathers each unit with its new shard."""

    def param_tensors(self) -> list[torch.Tensor]:
        return [t for u in self.units for t in (u.shard, u.full)]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    @property
    def padded_numel(self) -> int:
        return sum(u.layout.numel for u in self.units)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
