"""The per-rank bodies of minitron.verify: one step of the split model and of the reference, and
`run_rank`, the loop every rank runs (verify.py launches it, checks the options, prints).

The split model takes its step in one of three ways, by what the run splits:

  plain          ParallelGPT (tp, sp, cp): forward, loss, backward, model.finalize_grads()
  pipeline       PipelineGPT: the pipeline executor runs the schedule's actions
  data parallel  (dp > 1, a ZeRO stage, or 16-bit) either of the two on this rank's rows of the
                 global batch (data_parallel.local_rows; dropout masks are keyed by global row,
                 so the rank says where its rows start), with a data-parallel engine in place of
                 finalize_grads (DataParallel: buckets all-reduced, or reduce-scattered under
                 ZeRO 1-2, while backward runs; ZeroStage3) and ZeroOptimizer stepping fp32
                 master weights of this rank's shard. Logits and dL/dX are gathered back over dp
                 in row order and the loss averaged over dp: the whole batch's, as one device.
                 Expert parallelism (ep > 1) runs this way too: ep ranks are data-parallel
                 replicas of the dense layers (rows split over dp x ep, gathered back over
                 dense_dp), and the engine sums expert gradients over dp_cp only.

With experts the loss includes the routers' auxiliary losses on both sides, and one row per
step checks that a capacity factor dropped the reference's (token, expert) pairs, pair for pair.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm
from .context_parallel import shard_sequence, unshard_sequence
from .data_parallel import gathered_grads, gathered_params, load_grads, local_rows, wrap
from .grid import ParallelConfig, build_grid
from .model.config import ConfigError, ModelConfig
from .model.convert import gather_state_dict, grads_state_dict, shard_state_dict
from .model.parallel import ParallelGPT
from .moe.layer import check_moe_grid
from .model.reference import GPT
from .optim import FusedAdamW
from .pipeline.executor import collect_outputs, run_schedule
from .pipeline.partition import PipelineGPT
from .precision import LossScaler, MasterWeightsAdamW, optimizer_step, tolerance16
from .verify_checks import Row, float32_tolerance, grad_rows, replica_rows, sum_rows, update_rows
from .verify_plants import Plant

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
BUCKET_NUMEL = 4096       # small: even the tiny default model fills several buckets
FP16_LOSS_SCALE = 1024.0  # a fixed scale, the same on both sides (dynamic: precision.LossScaler)


def make_batch(step: int, seed: int, batch: int, seq: int, vocab: int):
    """The tokens and next-token targets of one step, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def uses_engine(pcfg: ParallelConfig, zero: int | None, dtype: torch.dtype) -> bool:
    """Whether the split model is stepped through a data-parallel engine and ZeroOptimizer."""
    return pcfg.dp > 1 or pcfg.ep > 1 or zero is not None or dtype in SIXTEEN_BIT


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def dtype_refusal(pcfg: ParallelConfig, mcfg: ModelConfig, dtype: torch.dtype, zero) -> str | None:
    """Why verify cannot compare this grid and model in `dtype`, or None."""
    if mcfg.n_experts and dtype in SIXTEEN_BIT:
        return ("a 16-bit router's top-k choice flips on the rounding differences between the two "
                "sides (a discontinuity no tolerance covers)")
    if dtype == torch.float64 and uses_engine(pcfg, zero, dtype):
        return ("the data-parallel engine (dp > 1, ep > 1 or a ZeRO stage) steps float32 master "
                "weights (ZeroOptimizer)")
    return None


def check_data_parallel(pcfg: ParallelConfig, mcfg: ModelConfig, dtype: torch.dtype,
                        zero: int | None, schedule) -> None:
    """Refuse, before any rank starts, what the data-parallel path does not run (ValueError)."""
    if zero not in (None, 0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    check_moe_grid(pcfg, mcfg)
    if mcfg.n_experts and (schedule is not None or zero == 3):
        raise ValueError("experts are verified without a pipeline and without ZeRO-3: use --pp 1 "
                         "and --zero 0, 1 or 2 with --experts")
    why = dtype_refusal(pcfg, mcfg, dtype, zero)
    if why:                                # one rule, so every refusal names the same dtypes
        works = [name for name, d in DTYPES.items() if not dtype_refusal(pcfg, mcfg, d, zero)]
        raise ConfigError("{dtype}: %s" % why, {"dtype": str(dtype).removeprefix("torch.")},
                          [{"dtype": name} for name in works])
    if not uses_engine(pcfg, zero, dtype):
        return
    refusals = [
        (pcfg.cp > 1 and (pcfg.ep > 1 or dtype in SIXTEEN_BIT),
         "context parallelism is verified with data parallelism and ZeRO in float32, without "
         "expert parallelism: use --cp with --ep 1 and --dtype float32"),
        (zero == 3 and mcfg.tie_embeddings, "ZeRO-3 gathers the embedding for its own forward only, "
                                            "a tied output layer reuses it later: drop --tie"),
        (dtype == torch.float16 and schedule is not None, "the pipeline executor takes no loss "
                                                          "scale: use --dtype bfloat16 with --pp"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(why)


def parallel_step(model: ParallelGPT, tokens, targets, step_seed: int, planted: Plant = Plant(None),
                  *, first_row: int = 0, loss_scale: float = 1.0, finish=None):
    """Forward, loss, backward and the gradient fix-up (`finish`, default model.finalize_grads);
    returns (X, logits shard, loss). `first_row`: where `tokens` start in the global batch."""
    model.rng.reset(step_seed)
    if first_row:
        model.rng.rows_from(first_row)
    x = model.embed(tokens)
    x.retain_grad()                      # dL/dX, X = the input of the first block
    with planted.attention():
        logits = model.output_layer(model.run_layers(x))
    loss = model.loss(logits, targets)
    (loss * loss_scale).backward()       # loss_scale: fp16 (1.0 is exact: no change)
    (finish or model.finalize_grads)()
    return x, logits, loss


def reference_step(ref: GPT, tokens, targets, step_seed: int, loss_dtype=torch.float32,
                   loss_scale: float = 1.0):
    """The same on the reference: what GPT.forward does, with X kept. (loss_dtype=float64 makes
    a float64 model exact up to float64 rounding: the oracle tests measure float32 against.)"""
    ref.rng.reset(step_seed)
    x = ref.embed(tokens)
    x.retain_grad()
    logits = ref.run_layers(x) @ ref.output_weight().t()
    loss = F.cross_entropy(logits.to(loss_dtype).flatten(0, 1), targets.flatten()) + ref.moe_loss()
    (loss * loss_scale).backward()
    return x, logits, loss


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


def _step(model, schedule, planted: Plant, tokens, targets, step_seed: int, engine=None,
          loss_scale: float = 1.0, first: int = 0):
    """One step of the split model: (logits [b, s, V], loss, dL/dX [b, s, h]) of the rows it
    ran (from row `first` of the global batch), on every rank of its data-parallel replica."""
    grid = model.grid
    if schedule is None:
        cp, layout = grid.cp, planted.cp_layout()   # context parallelism: this rank's chunks
        finish = engine.finish_grad_sync if engine is not None else None
        x, logits, loss = parallel_step(model, shard_sequence(tokens, cp.size, cp.rank, layout),
                                        shard_sequence(targets, cp.size, cp.rank, layout), step_seed,
                                        planted, first_row=first, loss_scale=loss_scale, finish=finish)
        planted.grads(model, grid)
        dx = comm.all_gather(x.grad, grid.tp, dim=1) if grid.sequence_parallel else x.grad
        logits = comm.all_gather(logits.detach(), grid.tp, dim=-1)
        if cp.size > 1:   # a rank's loss is the mean over its tokens: the reference's, averaged
            loss = comm.all_reduce(loss.detach().clone(), cp) / cp.size
            dx = unshard_sequence(dx, cp) / cp.size
            logits = unshard_sequence(logits, cp)
        return logits, loss, dx
    model.rng.reset(step_seed)
    if engine is None:
        result = run_schedule(schedule, model, tokens, targets, plant=planted)
    else:   # micro-batches accumulate quietly; every bucket is sent once, after the last
            # (ZeRO-3 reduce-scatters each micro-batch into the shard: data_parallel/zero3.py)
        with engine.no_sync():
            result = run_schedule(schedule, model, tokens, targets, plant=planted, first_row=first,
                                  finalize_grads=False)
        engine.finish_grad_sync()
    planted.grads(model, grid)
    return collect_outputs(result, model, *tokens.shape)


def data_parallel_step(model, schedule, planted: Plant, tokens, targets, step_seed: int, engine,
                       loss_scale: float):
    """This rank's rows through _step, then the whole batch's (logits, loss, dL/dX) on every
    rank: rows gathered over the replicas, dp x ep (= dense_dp when cp is 1); each rank's loss
    is the mean over its own rows, so the batch's is their mean and its dL/dX each rank's
    divided by their number. Under context parallelism (ep = 1) the cp ranks of a replica share
    its rows and split their sequences: rows go over dp, and _step has already gathered over cp
    (the engine still averages gradients over dense_dp = dp x cp: every rank saw other tokens)."""
    grid = model.grid
    if grid.cp.size > 1:
        b = tokens.shape[0] // grid.dp.size
        rows = slice(grid.dp.rank * b, (grid.dp.rank + 1) * b)
    else:
        rows = local_rows(tokens.shape[0], grid)
    logits, loss, dx = _step(model, schedule, planted, tokens[rows], targets[rows], step_seed,
                             engine, loss_scale, rows.start)
    replicas = grid.dp if grid.cp.size > 1 else grid.dense_dp
    n = replicas.size
    if n == 1:
        return logits, loss, dx
    return (comm.all_gather(logits.contiguous(), replicas, dim=0),
            comm.all_reduce(loss.detach().clone(), replicas) / n,
            comm.all_gather(dx.contiguous(), replicas, dim=0) / n)


def _gather_kept(layer, grid, batch: int) -> torch.Tensor:
    """An MoE layer's kept (token, choice) pairs of the whole batch, [b, s, k] (collective)."""
    keep = layer.routing.keep.view(batch // grid.dense_dp.size, -1, layer.cfg.topk).to(torch.uint8)
    if grid.sequence_parallel:
        keep = comm.all_gather(keep, grid.tp, dim=1)
    return comm.all_gather(keep, grid.dense_dp, dim=0).bool()


def drop_rows(step: int, kept: list[torch.Tensor], ref, shape) -> list[Row]:
    """One row: the pairs a capacity factor dropped must be the reference's, pair for pair."""
    if not kept:
        return []
    ref_kept = [m.routing.keep.view(*shape, -1) for m in ref.moe_layers()]
    differ = sum(int((a != b).sum()) for a, b in zip(kept, ref_kept))
    dropped = sum(int((~b).sum()) for b in ref_kept)
    detail = f"{differ} (token, expert) pairs kept on one side and dropped on the other" if differ else ""
    return [Row(step, f"moe drops ({dropped} pairs in the reference)", float(differ), 0.0, detail)]


class _OwnOptimizer:
    """The split model's own .grad and torch's AdamW (FusedAdamW with the kernels)."""
    engine, loss_scale, sharded_grads, sharded_weights = None, 1.0, False, False

    def __init__(self, model, lr: float, eps: float):
        self.model = model
        adamw = FusedAdamW if model.cfg.use_kernels else torch.optim.AdamW
        self.opt = adamw(model.parameters(), lr=lr, eps=eps)

    def grads(self) -> dict:
        return grads_state_dict(self.model)

    def weights(self) -> dict:
        return self.model.state_dict()

    @torch.no_grad()
    def load_grads(self, shards: dict) -> None:
        for name, shard in shards.items():
            self.model.get_parameter(name).grad.copy_(shard)

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _Engine:
    """A data-parallel engine (data_parallel.wrap) and ZeroOptimizer on fp32 master shards; the
    mixed-precision step of data_parallel/__init__.py (fp16: a fixed loss scale)."""

    def __init__(self, model, grid, zero: int | None, lr: float, eps: float, planted: Plant):
        if getattr(model, "tied_across_ranks", False):   # summed over the embedding group first
            model.embedding.word.weight.shared_embedding = True
        self.grid, self.zero = grid, zero or 0
        self.engine, self.opt = wrap(model, grid, self.zero, BUCKET_NUMEL, lr=lr, eps=eps)
        planted.engine(self.engine)
        fp16 = next(model.parameters()).dtype == torch.float16
        self.scaler = LossScaler(FP16_LOSS_SCALE, growth_interval=10**9) if fp16 else None
        self.loss_scale = self.scaler.scale if fp16 else 1.0
        self.sharded_grads = not self.engine.grads_replicated   # rebuilt: equal over dp by construction
        self.sharded_weights = self.zero == 3

    def grads(self) -> dict:
        return gathered_grads(self.engine)

    def weights(self) -> dict:
        return gathered_params(self.engine)

    def load_grads(self, shards: dict) -> None:
        load_grads(self.engine, shards)

    def step(self) -> None:
        optimizer_step(self.opt, self.engine, self.grid, self.scaler)
        self.engine.zero_grad()


def run_rank(pcfg: ParallelConfig, mcfg: ModelConfig, steps: int, dtype: torch.dtype = torch.float32,
             seed: int = 0, lr: float = 1e-4, eps: float = 1e-6, batch: int = 2,
             seq: int | None = None, plant: str | None = None, schedule=None,
             zero: int | None = None) -> list[Row] | None:
    """The body every rank runs; rank 0 also runs the reference and returns the rows.

    `schedule` (a pipeline Schedule, see verify.pipeline_schedule): the model is cut into its
    stages and every step runs it with the pipeline executor; the batch is cut into its
    micro-batches. `zero` (0-3), dp > 1 or a 16-bit dtype: a data-parallel engine (module
    docstring). `plant` (tests only, see verify_plants.PLANTS) puts a deliberate error in."""
    grid = build_grid(pcfg)
    lead, seq, planted = grid.rank == 0, seq or mcfg.seq_len, Plant(plant)
    ref = GPT(mcfg, seed).to(dtype)
    placement = schedule.stage_rank if schedule is not None else None
    if schedule is None:
        model = ParallelGPT.from_reference(ref, grid)
    else:
        model = PipelineGPT.from_reference(ref, grid, placement)
    tied_across_stages = getattr(model, "tied_across_ranks", False)
    planted.install(model)
    ref.to(grid.device)   # masks are drawn on the tensors' device: the same stream as the ranks'
    if uses_engine(pcfg, zero, dtype):
        side = _Engine(model, grid, zero, lr, eps, planted)
    else:   # the kernels' run steps with the fused AdamW kernel too; the reference never does
        side = _OwnOptimizer(model, lr, eps)
    sixteen = dtype in SIXTEEN_BIT
    ref_opt = (MasterWeightsAdamW(ref, lr=lr, eps=eps) if sixteen
               else torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps))
    tol = tolerance16(dtype) if sixteen else float32_tolerance(mcfg, batch, seq)
    scale = side.loss_scale
    rows: list[Row] = []
    for step in range(steps):
        tokens, targets = (t.to(grid.device) for t in make_batch(step, seed, batch, seq, mcfg.vocab_size))
        step_seed = seed * 1_000 + step       # each step's dropout masks, on both sides
        if side.engine is None:
            logits, loss, dx = _step(model, schedule, planted, tokens, targets, step_seed)
        else:
            logits, loss, dx = data_parallel_step(model, schedule, planted, tokens, targets,
                                                  step_seed, side.engine, scale)
        # Gather what rank 0 compares (collectives: every rank takes part).
        full_logits = planted.logits(logits)
        local_grads = side.grads()
        grads = gather_state_dict(local_grads, mcfg, grid, placement)
        grad_replicas = replica_rows(step, "grads", local_grads, mcfg, grid, tied_across_stages,
                                     over_dp=not side.sharded_grads)
        moe = model.moe_layers() if hasattr(model, "moe_layers") else []
        kept = [_gather_kept(m, grid, tokens.shape[0]) for m in moe]
        if lead:
            ref_x, ref_logits, ref_loss = reference_step(ref, tokens, targets, step_seed, loss_scale=scale)
            rows += sum_rows(step, {"logits": (full_logits, ref_logits), "loss": (loss, ref_loss),
                                    "dL/dX": (dx, ref_x.grad)}, tol)
            rows += drop_rows(step, kept, ref, tokens.shape)
            rows += grad_rows(step, grads, grads_state_dict(ref), tol) + grad_replicas
        # Both optimizers step on the reference's gradients: the step is checked on its own.
        ref_grads = _from_rank0({n: p.grad if lead else torch.empty_like(p)
                                 for n, p in ref.named_parameters()}, grid)
        side.load_grads(shard_state_dict(ref_grads, mcfg, grid, placement))
        old = gather_state_dict(side.weights(), mcfg, grid, placement)
        planted.before_step(model)
        side.step()
        planted.after_step(model, grid)
        local_weights = side.weights()
        weight_replicas = replica_rows(step, "weights", local_weights, mcfg, grid, tied_across_stages,
                                       over_dp=not side.sharded_weights)
        new = gather_state_dict(local_weights, mcfg, grid, placement)
        if lead:
            ref_old = {n: p.detach().clone() for n, p in ref.named_parameters()}
            ref_opt.step(**({"grad_scale": scale} if sixteen else {}))
            ref.zero_grad(set_to_none=True)
            ref_new = {n: p.detach() for n, p in ref.named_parameters()}
            rows += update_rows(step, new, old, ref_new, ref_old) + weight_replicas
    return rows if lead else None
