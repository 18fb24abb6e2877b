"""ZeRO: the optimizer (stages 1-2) and then the parameters themselves (stage 3), sharded over dp.

Mixed-precision Adam keeps, per parameter, 2 bytes of 16-bit weight, 2 of 16-bit gradient and
12 of optimizer state (fp32 master weight, first and second moment): 16 bytes, replicated on
every data-parallel rank. ZeRO (Rajbhandari et al. 2020) stops replicating; at Ψ parameters
and N ranks, per rank:

    plain DP   2Ψ + 2Ψ + 12Ψ         all-reduce the gradients
    stage 1    2Ψ + 2Ψ + 12Ψ/N       reduce-scatter grads, step my 1/N, all-gather weights
    stage 2    2Ψ + 2Ψ/N + 12Ψ/N     ... and keep only my 1/N of the gradients
    stage 3    2Ψ/N + 2Ψ/N + 12Ψ/N   ... and of the weights: gather each layer when needed

Stages 1 and 2 send what plain DP sends (a ring all-reduce is a reduce-scatter plus an
all-gather); stage 3 gathers the weights twice (forward, and again for backward: they were
freed in between), so it sends 1.5 times as much. memory.py has the formulas; tests measure.

ZeroOptimizer is AdamW (torch.optim.AdamW's arithmetic: decoupled decay, bias correction) on
fp32 master copies of the elements this rank owns. AdamW is elementwise, so stepping every
rank's shard is stepping the whole model. It reads its shards from an engine: DataParallel
(ddp.py, stages 0-2; stage 0 owns everything) or ZeroStage3 (below). One training step:

    engine = DataParallel(model, grid, zero_stage=1)    # or ZeroStage3(model, grid)
    opt = ZeroOptimizer(engine, lr=1e-4, weight_decay=0.01)
    engine.zero_grad(); loss.backward(); engine.finish_grad_sync(); opt.step()
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm, comm_async
from ..grid import Grid
from ..kernels import ops
from .buffer import FlatLayout, flatten_into
from .ddp import sum_sequence_parallel_grads


class ZeroOptimizer:
    """AdamW on fp32 master weights of the owned elements; writes back the 16-bit weights.

    `step(grad_scale=s)` divides the gradients by s first (in fp32): loss scaling and
    gradient clipping fold into it (minitron.precision)."""

    def __init__(self, engine, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"ZeroOptimizer: need lr, eps, weight_decay >= 0 and betas in [0, 1); "
                             f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}")
        self.engine = engine
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        owned, in_place = one_flat(engine.owned_params())
        # An fp32 model is its own master copy: step its owned elements in place (no second
        # copy, nothing to write back). A 16-bit model gets fp32 masters.
        self.master_is_model = in_place and owned.dtype == torch.float32
        self.master = owned if self.master_is_model else owned.detach().float().clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        grads = one_flat(self.engine.owned_grads())[0].float()   # no copy for fp32 in one piece
        if grad_scale != 1.0:
            grads = grads / grad_scale              # not in place: it may be the engine's buffer
        self.step_count += 1
        beta1, beta2 = self.betas
        ops.fused_adamw_step(self.master, grads, self.exp_avg, self.exp_avg_sq, lr=self.lr,
                             beta1=beta1, beta2=beta2, eps=self.eps,
                             weight_decay=self.weight_decay, step=self.step_count)
        if not self.master_is_model:
            owned = self.engine.owned_params()
            for param, master in zip(owned, self.master.split([t.numel() for t in owned])):
                param.copy_(master)                 # rounds to the model's dtype
        self.engine.after_step()

    def state_tensors(self) -> list[torch.Tensor]:
        """What this optimizer adds: the moments, and the fp32 masters unless they are the model."""
        masters = [] if self.master_is_model else [self.master]
        return masters + [self.exp_avg, self.exp_avg_sq]


def one_flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(`tensors` end to end as one flat tensor, whether that is a view of theirs): a view when
    they lie end to end in one storage (one bucket, a stage-3 shard), else a copy."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != storage
                or t.storage_offset() != offset):
            return torch.cat([t.reshape(-1) for t in tensors]), False
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,)), True


# ---- stage 3 ---------------------------------------------------------------------------------
def default_units(model: nn.Module) -> list[nn.Module]:
    """One unit per layer, plus the embedding, the final norm and the output layer."""
    if not hasattr(model, "layers"):
        raise ValueError("ZeroStage3 needs units= (the modules to gather one at a time) for a "
                         "model without .layers")
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        raise ValueError("ZeroStage3 gathers the embedding unit for the embedding's forward only, "
                         "but a tied output layer reuses its weight later: use tie_embeddings=False")
    names = ["embedding", "final_norm", "lm_head"]
    units = [getattr(model, "embedding")] + list(model.layers)
    return units + [getattr(model, n) for n in names[1:] if hasattr(model, n)]


class _Unit:
    """One module's parameters: a persistent 1/n shard and a full buffer that exists only
    while gathered (its storage is resized to 0 in between; the parameters stay views of it)."""

    def __init__(self, module: nn.Module, group, rank: int):
        params = [p for p in module.parameters() if p.requires_grad]
        n = group.size
        self.module, self.group, self.params = module, group, params
        self.layout = FlatLayout(params, None, pad_to=n)
        first = params[0]
        self.full = flatten_into(self.layout, first.dtype, first.device)
        size = self.layout.numel // n
        self.range = (rank * size, (rank + 1) * size)
        self.shard = self.full[self.range[0]:self.range[1]].clone()   # ZeroStage3 re-homes these
        self.grad_shard = torch.zeros_like(self.shard)
        self.gathered, self.ready = True, 0
        self.free()

    def gather(self) -> None:
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        comm_async.all_gather(self.shard, self.group, out=self.full).wait()
        self.gathered = True

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_grads(self, scale: float) -> None:
        """All gradients of the unit are in: reduce-scatter them into my shard, free them."""
        data = torch.zeros(self.layout.numel, dtype=self.shard.dtype, device=self.shard.device)
        for p in self.params:
            if p.grad is not None:
                self.layout.view(data, p).copy_(p.grad)
            p.grad = None
        data.mul_(scale)
        self.grad_shard.add_(comm.reduce_scatter(data, self.group))
        self.ready = 0


class ZeroStage3:
    """Parameters, gradients and optimizer state all sharded over the data-parallel group.

    Each unit (default: one per layer, plus embedding, final norm, output layer) is gathered
    just before its forward and freed right after; gathered again when backward reaches it (a
    hook on its output's gradient) and freed once all its gradients are in, which are then
    reduce-scattered into this rank's gradient shard (every backward: micro-batches add up
    in the shard). Dense parameters only (experts would shard over dp_cp).
    """

    def __init__(self, model: nn.Module, grid: Grid, units: list[nn.Module] | None = None):
        self.model, self.grid = model, grid
        units = units if units is not None else default_units(model)
        self.names = {p: n for n, p in model.named_parameters()}
        owned = [p for u in units for p in u.parameters() if p.requires_grad]
        wanted = [p for p in model.parameters() if p.requires_grad]
        if len(owned) != len(set(owned)) or set(owned) != set(wanted):
            raise ValueError("ZeroStage3 units must hold every trainable parameter exactly once: "
                             f"{len(set(wanted) - set(owned))} left out, "
                             f"{len(owned) - len(set(owned))} in two units")
        if any(getattr(p, "allreduce", True) is False for p in wanted):
            raise ValueError("ZeroStage3 shards dense parameters over dense_dp; expert parameters "
                             "(allreduce=False) are not supported yet: use DataParallel")
        self.group = grid.dense_dp
        self.scale = 1.0 / grid.dense_dp.size
        rank = self.group.rank
        self.units = [_Unit(u, self.group, rank) for u in units]
        # All shards end to end in one tensor (and the gradient shards in another), so the
        # optimizer steps them as one flat tensor, as it does a DataParallel bucket.
        self.shards = torch.cat([u.shard for u in self.units])
        self.grad_shards = torch.zeros_like(self.shards)
        offset = 0
        for u in self.units:
            n = u.shard.numel()
            u.shard, u.grad_shard = self.shards[offset:offset + n], self.grad_shards[offset:offset + n]
            offset += n
        self.unit_of = {p: u for u in self.units for p in u.params}
        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(lambda m, a, u=u: u.gather()))
            self._hooks.append(u.module.register_forward_hook(
                lambda m, a, out, u=u: self._after_forward(u, out)))
        for p in wanted:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _after_forward(self, unit: _Unit, out) -> None:
        unit.free()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, u=unit: (u.gather(), g)[1])

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        unit.ready += 1
        if unit.ready == len(unit.params):
            unit.reduce_grads(self.scale)
            unit.free()

    # ---- the engine API (as DataParallel's) ------------------------------------------
    def finish_grad_sync(self) -> None:
        for u in self.units:
            if u.ready:                       # some parameters got no gradient this step
                u.reduce_grads(self.scale)
                u.free()
        sum_sequence_parallel_grads(self, self.grid)

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard.zero_()
            u.ready = 0
            for p in u.params:
                p.grad = None

    def owned_params(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units]

    def owned_grads(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    def grad_pieces(self, p: nn.Parameter) -> list[tuple[int, torch.Tensor]]:
        u = self.unit_of[p]
        return [(i, u.grad_shard[j:j + ln]) for i, j, ln in u.layout.pieces(p, [u.range])]

    def param_pieces(self, p: nn.Parameter) -> list[tuple[int, torch.Tensor]]:
        u = self.unit_of[p]
        return [(i, u.shard[j:j + ln]) for i, j, ln in u.layout.pieces(p, [u.range])]

    @property
    def parameters(self):
        return list(self.unit_of)

    grads_replicated = False

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
