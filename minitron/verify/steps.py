"""The per-rank body of minitron.verify: the split model's steps, taken by the one training
engine (train/engine.py), against the reference's, and `run_rank`, the loop every rank runs
(run.py launches it, cli.py checks the options and prints).

Each step compares, on rank 0: logits, loss, dL/dX and every gradient of the split model
(gathered from its shards) with the reference's, and the bitwise equality of every replica.
Then the engine's gradients are replaced by the reference's (TrainingRun.load_grads, the one
hook verification needs) and both optimizers step on them, so the update is checked on its
own. With experts the loss includes the routers' auxiliary losses on both sides, one row
per step checks that a capacity factor dropped the reference's (token, expert) pairs, pair for
pair, and with expert biases one row the biases after both updates (bias_rows.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data_parallel.precision import MasterWeightsAdamW
from ..grid import ParallelConfig
from ..config import ModelConfig
from ..model.convert import gather_state_dict, grads_state_dict, shard_state_dict
from ..model.reference import GPT
from ..runtime import comm
from ..train.engine import SIXTEEN_BIT, TrainingRun
from .fp8_rows import gathered_scales, pow2_row, scale_row
from .checks import (Row, float32_tolerance, grad_rows, noise_rows, noise_stats, replica_rows, sum_rows,
                     update_rows)
from . import noise, routing
from .bias_rows import bias_rows, gathered_biases
from .plants import Plant

BUCKET_NUMEL = 4096       # small: even the tiny default model fills several buckets
FP16_LOSS_SCALE = 1024.0  # a fixed scale, the same on both sides (dynamic: precision.LossScaler)
WEIGHT_DECAY = 1e-2       # torch.optim.AdamW's default, which the reference keeps


def make_batch(step: int, seed: int, batch: int, seq: int, vocab: int):
    """The tokens and next-token targets of one step, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def reference_step(ref: GPT, tokens, targets, step_seed: int, loss_dtype=torch.float32,
                   loss_scale: float = 1.0, microbatches: int = 1,
                   choices: list | None = None, scores: list | None = None):
    """The same on the reference: what GPT.forward does, with X kept. (loss_dtype=float64 makes
    a float64 model exact up to float64 rounding: the oracle tests measure float32 against.)

    microbatches > 1 (experts inside pipeline stages): the routers' auxiliary losses are over
    each micro-batch, as the split model's are, so the reference runs the same micro-batches:
    micro-batch k is rows [k*B/m, (k+1)*B/m), whatever the replicas (train.step.replica_rows).
    `choices`, a list: filled with the routers' choices of the whole batch, [b, s, k] per MoE
    layer (micro-batch by micro-batch, as they were made); `scores` with the scores they chose
    by, [b, s, E] (routing.reference_scores)."""
    if microbatches > 1:
        return _reference_microbatches(ref, tokens, targets, step_seed, loss_dtype, loss_scale,
                                       microbatches, choices, scores)
    ref.rng.reset(step_seed)
    x = ref.embed(tokens)
    x.retain_grad()
    logits = ref.run_layers(x) @ ref.output_weight().t()
    loss = F.cross_entropy(logits.to(loss_dtype).flatten(0, 1), targets.flatten()) + ref.moe_loss()
    (loss * loss_scale).backward()
    if choices is not None:
        choices[:] = routing.reference_choices(ref, tokens.shape)
    if scores is not None:
        scores[:] = routing.reference_scores(ref, tokens.shape)
    return x, logits, loss


def _reference_microbatches(ref, tokens, targets, step_seed, loss_dtype, loss_scale, m,
                            choices=None, scores=None):
    mb = tokens.shape[0] // m
    grads, logits_all, chosen, by, loss = [], [], [], [], 0.0
    for k in range(m):
        rows = slice(k * mb, (k + 1) * mb)
        ref.rng.reset(step_seed)
        ref.rng.rows_from(k * mb)                 # the masks of those global rows
        x = ref.embed(tokens[rows])
        x.retain_grad()
        logits = ref.run_layers(x) @ ref.output_weight().t()
        if choices is not None:
            chosen.append(routing.reference_choices(ref, tokens[rows].shape))
        if scores is not None:
            by.append(routing.reference_scores(ref, tokens[rows].shape))
        part = F.cross_entropy(logits.to(loss_dtype).flatten(0, 1), targets[rows].flatten()) + ref.moe_loss()
        (part * loss_scale / m).backward()
        grads.append(x.grad)
        logits_all.append(logits.detach())
        loss = loss + part.detach() / m
    if choices is not None:                      # per MoE layer, the micro-batches' in row order
        choices[:] = [torch.cat(layer) for layer in zip(*chosen)]
    if scores is not None:
        scores[:] = [torch.cat(layer) for layer in zip(*by)]
    x_all = torch.cat(grads)
    x_all.grad = x_all.clone()                   # what the callers read: dL/dX in row order
    return x_all, torch.cat(logits_all), loss


def _from_rank0(tensors: dict, grid) -> dict:
    """Every rank gets rank 0's tensors (one counted broadcast over the world)."""
    world = comm.Group("world", range(grid.world_size))   # pg None: torch's default group
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    comm.broadcast(flat, world, src=0)
    out, offset = {}, 0
    for name, t in tensors.items():
        out[name] = flat[offset:offset + t.numel()].view_as(t)
        offset += t.numel()
    return out


def _gather_kept(layer, grid, batch: int) -> torch.Tensor:
    """An MoE layer's kept (token, choice) pairs of the whole batch, [b, s, k] (collective)."""
    return routing.gather_pairs(layer.routing.keep.to(torch.uint8), grid, batch).bool()


def drop_rows(step: int, kept: list[torch.Tensor], ref, shape) -> list[Row]:
    """One row: the pairs a capacity factor dropped must be the reference's, pair for pair."""
    if not kept:
        return []
    ref_kept = [m.routing.keep.view(*shape, -1) for m in ref.moe_layers()]
    differ = sum(int((a != b).sum()) for a, b in zip(kept, ref_kept))
    dropped = sum(int((~b).sum()) for b in ref_kept)
    detail = f"{differ} (token, expert) pairs kept on one side and dropped on the other" if differ else ""
    return [Row(step, f"moe drops ({dropped} pairs in the reference)", float(differ), 0.0, detail)]


def run_rank(pcfg: ParallelConfig, mcfg: ModelConfig, steps: int, dtype: torch.dtype = torch.float32,
             seed: int = 0, lr: float = 1e-4, eps: float = 1e-6, batch: int = 2,
             seq: int | None = None, plant: str | None = None, schedule=None,
             zero: int | None = None, reference_routing: bool | None = None, fp8=None) -> list[Row] | None:
    """The body every rank runs; rank 0 also runs the reference and returns the rows.

    `schedule` (a pipeline Schedule, see train.engine.resolve_schedule): the model is cut into
    its stages and every step runs it with the pipeline executor; the batch is cut into its
    micro-batches. `zero` (0-3), dp or ep > 1 or a 16-bit dtype: a data-parallel engine
    (train/engine.py). `plant` (tests only, see plants.PLANTS) puts a deliberate error in.
    `reference_routing`: the split model's routers take the reference's choices (routing.py);
    None: only in 16 bits and FP8, where a rounding may flip a top-k."""
    seq, planted = seq or mcfg.seq_len, Plant(plant)
    ref = GPT(mcfg, seed).to(dtype)
    planted.resolve(ref)
    if fp8 is not None:     # the same FP8 GEMMs, at the split's casting points (fused qkv, [gate; up])
        ref.enable_fp8(fp8)
    run = TrainingRun(mcfg, pcfg, schedule=schedule, zero_stage=zero, dtype=dtype, lr=lr, eps=eps,
                      weight_decay=WEIGHT_DECAY, max_norm=None, bucket_numel=BUCKET_NUMEL,
                      loss_scale=planted.loss_scale(FP16_LOSS_SCALE), reference=ref, hooks=planted,
                      fp8=fp8)
    model, grid, placement = run.model, run.grid, run.placement
    lead = grid.rank == 0
    tied_across_stages = model.tied_across_ranks
    planted.install(model)
    if run.engine is not None:
        planted.engine(run.engine)
    ref.to(grid.device)   # masks are drawn on the tensors' device: the same stream as the ranks'
    # 16 bits and FP8: the reference in the same precision (fp32 master weights), its errors
    # held against the noise of that precision (checks.noise_rows, verify/noise.py)
    low = dtype in SIXTEEN_BIT
    if reference_routing is None:
        reference_routing = bool(mcfg.n_experts) and low
    ref_opt = (MasterWeightsAdamW(ref, lr=lr, eps=eps) if low
               else torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps, weight_decay=WEIGHT_DECAY))
    tol = float32_tolerance(mcfg, batch, seq)
    # which choices the routers made, against the reference's: 16-bit experts or imposed choices;
    # inside pipeline stages micro-batch by micro-batch (routing.MicroBatchRouting)
    count_choices = bool(mcfg.n_experts) and (low or reference_routing)
    per_micro = routing.MicroBatchRouting(model, grid, run.schedule.microbatches) \
        if count_choices and run.schedule is not None else None
    n_moe_layers = sum(mcfg.is_moe_layer(i) for i in range(mcfg.n_layers))
    ref_scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
    rows: list[Row] = []
    for step in range(steps):
        tokens, targets = (t.to(grid.device) for t in make_batch(step, seed, batch, seq, mcfg.vocab_size))
        step_seed = seed * 1_000 + step       # each step's dropout masks, on both sides
        scale = run.loss_scale if run.scaler is None else run.scaler.scale   # this step's
        # the routers' losses, and FP8's amaxes, are per micro-batch: so is the reference then
        per_microbatch = run.schedule is not None and (mcfg.n_experts or fp8 is not None)

        ref_choices: list = []        # the reference's routers' choices, [b, s, k] per layer
        ref_scores: list = []         # and the scores they chose by, [b, s, E]

        def reference(model=ref):
            return reference_step(model, tokens, targets, step_seed, loss_scale=ref_scale,
                                  microbatches=run.schedule.microbatches if per_microbatch else 1,
                                  choices=ref_choices if model is ref else None,
                                  scores=ref_scores if model is ref else None)
        twins = [noise.twin(ref) for _ in noise.SPLITS] if lead and low else []   # before it steps
        ref_out, imposed = None, None
        if reference_routing:     # the reference first: its routers' choices go to the split side
            ref_out = reference() if lead else None
            imposed = routing.share_reference_choices(ref_choices, grid, n_moe_layers,
                                                      tokens.shape, mcfg.topk)
            if per_micro is None:
                routing.impose(model, imposed, grid)
        if per_micro is not None:
            per_micro.start(tokens.shape, imposed)
        out = run.forward_backward(tokens, targets, step_seed, keep_outputs=True)
        # Gather what rank 0 compares (collectives: every rank takes part).
        full_logits = planted.logits(out.logits)
        local_grads = run.grads()
        grads = gather_state_dict(local_grads, mcfg, grid, placement)
        grad_replicas = replica_rows(step, "grads", local_grads, mcfg, grid, tied_across_stages,
                                     over_dp=not run.sharded_grads)
        scales = gathered_scales(model, ref, grid) if fp8 is not None else None
        # which (token, expert) pairs a capacity factor dropped: whole-batch routing, no pipeline
        kept = [_gather_kept(m, grid, tokens.shape[0]) for m in model.moe_layers()] \
            if run.schedule is None else []
        if per_micro is not None:
            used = per_micro.gathered(tokens.shape, "used")
            own = per_micro.gathered(tokens.shape, "own") if reference_routing else None
        else:
            layers = model.moe_layers() if count_choices else []
            used = [routing.gather_pairs(m.routing.experts, grid, tokens.shape[0]) for m in layers]
            own = [routing.gather_pairs(m.routing.own, grid, tokens.shape[0]) for m in layers] \
                if reference_routing else None
        if lead:
            ref_x, ref_logits, ref_loss = ref_out or reference()
            rows += routing.routing_rows(step, used, own, ref_choices, mcfg.n_experts, ref_scores,
                                         torch.finfo(dtype).eps) if count_choices else []
            if low:
                outs = []
                for frac, twin in zip(noise.SPLITS, twins):
                    with noise.another_order(frac):
                        outs.append((*reference(twin), twin))
                rows += low_precision_rows(step, out, full_logits, grads, scale,
                                           (ref_x, ref_logits, ref_loss, ref), ref_scale, outs)
            else:
                rows += sum_rows(step, {"logits": (full_logits, ref_logits), "loss": (out.loss, ref_loss),
                                        "dL/dX": (out.dx, ref_x.grad)}, tol)
                rows += grad_rows(step, grads, grads_state_dict(ref), tol)
            rows += drop_rows(step, kept, ref, tokens.shape) + grad_replicas
            if scales is not None:
                rows += [scale_row(step, scales, ref, twins)]
            if scales is not None and fp8.scaling == "mxfp8":
                rows += [pow2_row(step, scales, ref)]
        # Both optimizers step on the reference's gradients: the step is checked on its own.
        ref_grads = _from_rank0({n: p.grad if lead else torch.empty_like(p)
                                 for n, p in ref.named_parameters()}, grid)
        if scale != ref_scale:     # the split side's loss scale is its own (a plant)
            ref_grads = {n: (g.float() * (scale / ref_scale)).to(g.dtype) for n, g in ref_grads.items()}
        run.load_grads(shard_state_dict(ref_grads, mcfg, grid, placement))
        old = gather_state_dict(run.weights(), mcfg, grid, placement)
        old_masters = run.masters() if low else None
        planted.before_step(model, run)
        run.optimizer_step()
        planted.after_step(model, grid, run)
        biases = gathered_biases(model, grid)            # every rank's, after its update
        local_weights = run.weights()
        weight_replicas = replica_rows(step, "weights", local_weights, mcfg, grid, tied_across_stages,
                                       over_dp=not run.sharded_weights)
        new = gather_state_dict(local_weights, mcfg, grid, placement)
        new_masters = run.masters() if low else None
        if low:   # the fp32 masters, where the update is made, in the reference's names
            old_masters, new_masters = (gather_state_dict(m, mcfg, grid, placement)
                                        for m in (old_masters, new_masters))
        if lead:
            ref_old = {n: p.detach().clone() for n, p in ref.named_parameters()}
            ref_old_masters = dict(zip(ref_old, (m.detach().clone() for m in ref_opt.masters))) if low else None
            ref_opt.step(**({"grad_scale": ref_scale} if low else {}))
            ref.zero_grad(set_to_none=True)
            ref_new = {n: p.detach() for n, p in ref.named_parameters()}
            rows += update_rows(step, new, old, ref_new, ref_old) + weight_replicas
            rows += bias_rows(step, biases, ref)        # updates the reference's biases first
            if low:
                ref_new_masters = dict(zip(ref_new, (m.detach() for m in ref_opt.masters)))
                rows += update_rows(step, new_masters, old_masters, ref_new_masters, ref_old_masters,
                                    kind="master")
    return rows if lead else None


def low_precision_rows(step: int, out, logits, grads: dict, scale: float, ref, ref_scale: float,
                       twins: list) -> list[Row]:
    """Logits, loss, dL/dX and every gradient against the reference in the same precision,
    each held to the noise of the twins (the reference run in other orders: noise.py), each
    twin (dL/dX, logits, loss, model) like `ref`. Each side's gradients are divided by its
    own loss scale first."""
    ref_x, ref_logits, ref_loss, ref_model = ref
    tw_x = [t[0].grad.double() / ref_scale for t in twins]
    tw_logits, tw_loss = [t[1] for t in twins], [t[2] for t in twins]
    logits_floor = noise_stats(logits, ref_logits, tw_logits).floor
    rows = noise_rows(step, "", {"logits": (logits, ref_logits, tw_logits)})
    # a scalar's twins may land on the reference by chance: the loss's floor is at least the logits'
    rows += noise_rows(step, "", {"loss": (out.loss, ref_loss, tw_loss)}, floor_min=logits_floor,
                       along=False)
    rows += noise_rows(step, "", {"dL/dX": (out.dx.double() / scale, ref_x.grad.double() / ref_scale,
                                            tw_x)})
    ref_grads = grads_state_dict(ref_model)
    tw_grads = [grads_state_dict(t[3]) for t in twins]
    rows += noise_rows(step, "grad", {n: (grads[n].double() / scale, g.double() / ref_scale,
                                          [t[n].double() / ref_scale for t in tw_grads])
                                      for n, g in ref_grads.items()})
    return rows
