"""python -m minitron.verify --tp 2 --sp [--pp 2 --schedule zb-h1]: the split model against one device.

Both models start from the same weights and the same dropout seed and see the same batches.
Every step compares, on rank 0 after gathering the shards (for the comparison only): logits,
loss, dL/dX (X = the input of the first block) and every weight gradient, each against the
float32 rounding bar of minitron.verify_checks (C * sqrt(K) * eps32 for sums of K terms).
Then both sides take one AdamW step on the same gradients, the reference's (each rank steps
its shards: AdamW is elementwise), and every tensor's update w_new - w_old is compared with
the reference's at the update's own scale. On every rank, the tensors a group holds whole
(norm weights, row-parallel biases, positions under tp) must be bitwise identical across it,
gradients and weights: the `replicas` rows, which name the tensor and ranks that differ.

Prints one row per (step, quantity) with the worst relative error and its tolerance, the
smallest margin (tolerance / error), then `PASS max_rel_err=...` (exit 0) or `FAIL ...`
(exit 1). Gradients and updates are grouped by name with the layer index replaced by `*`
(worst over the layers), covering every parameter.

AdamW's eps defaults to 1e-6 here, not torch's 1e-8: a gradient entry at the float32 noise
level (~1e-7 of its tensor's largest) counts as noise, not as a direction worth lr. (The check
no longer depends on it: both sides step on the same gradients, so `--eps 1e-8` passes too.)

`--pp`, `--virtual`, `--schedule` and `--microbatches` cut the model into pipeline stages
(pipeline/partition.py) and run every step with the pipeline executor and the named schedule
(pipeline/schedules.py): the same rows are compared, with the logits of every micro-batch and
dL/dX collected from the stages that made them, every gradient and weight gathered across the
stages, and the tied embedding's two copies (first and last stage) bitwise equal over the
`embedding` group. The batch defaults to one sequence per micro-batch.

`--kernels` builds the split model with ModelConfig(use_kernels=True), so its norms, attention,
MLP activations and loss run minitron.kernels' fused Triton kernels, and steps it with
FusedAdamW; the reference keeps plain torch ops and torch.optim.AdamW, and the tolerances stay
the same. Where the ranks run on the CPU (no GPU for each of them) it sets TRITON_INTERPRET=1
before anything imports triton, so the kernels run in Triton's interpreter (slowly), and says
so in the header.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

from . import comm
from .context_parallel import shard_sequence, unshard_sequence
from .grid import CP_VARIANTS, ParallelConfig, build_grid, validate_model
from .launch import DEFAULT_TIMEOUT, _pick_backend, launch
from .model.config import CHOICES, ModelConfig
from .model.convert import gather_state_dict, grads_state_dict, shard_state_dict
from .model.fused import check_kernels
from .model.parallel import ParallelGPT
from .model.reference import GPT
from .optim import FusedAdamW
from .pipeline.executor import collect_outputs, run_schedule
from .pipeline.partition import PipelineGPT
from .pipeline.schedules import SCHEDULES, make_schedule
from .verify_checks import (Report, Row, float32_tolerance, grad_rows, replica_rows,
                            sum_rows, update_rows)
from .verify_plants import Plant


# Dimensions with a ParallelConfig field but no implementation yet: option -> (what, issue).
UNBUILT = {"dp": ("data parallelism", "data parallel and ZeRO, lesson 06"),
           "ep": ("expert parallelism", "mixture of experts, lesson 08")}


def check_built(pcfg: ParallelConfig) -> None:
    for field, (what, issue) in UNBUILT.items():
        if getattr(pcfg, field) > 1:
            raise NotImplementedError(f"{what} is not built yet (issue: {issue}); "
                                      f"set {field}=1")


def enable_kernels(mcfg: ModelConfig, world_size: int) -> str:
    """Make minitron.kernels runnable on the ranks launch() will start; say how they run.

    Ranks on GPUs run the compiled kernels. Ranks on the CPU need Triton's interpreter, which
    triton.jit picks when triton is first imported: so TRITON_INTERPRET=1 goes into this
    process's environment here, before anything imports triton, and the forked ranks inherit
    it. Raises ValueError (before any rank starts) where the kernels still cannot run.
    """
    if _pick_backend(world_size) == "nccl":
        check_kernels(mcfg, torch.device("cuda"))
        return "kernels=compiled Triton on the GPUs"
    os.environ["TRITON_INTERPRET"] = "1"
    check_kernels(mcfg, torch.device("cpu"))   # e.g. triton already imported without it
    return ("kernels=Triton interpreter on the CPU (TRITON_INTERPRET=1 set by minitron.verify: "
            "no GPU per rank)")


def make_batch(step: int, seed: int, batch: int, seq: int, vocab: int):
    """The tokens and next-token targets of one step, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def parallel_step(model: ParallelGPT, tokens, targets, step_seed: int, planted: Plant = Plant(None)):
    """Forward, loss, backward and the gradient fix-up; returns (X, logits shard, loss)."""
    model.rng.reset(step_seed)
    x = model.embed(tokens)
    x.retain_grad()                      # dL/dX, X = the input of the first block
    with planted.attention():
        logits = model.output_layer(model.run_layers(x))
    loss = model.loss(logits, targets)
    loss.backward()
    model.finalize_grads()
    return x, logits, loss


def reference_step(ref: GPT, tokens, targets, step_seed: int, loss_dtype=torch.float32):
    """The same on the reference: what GPT.forward does, with X kept. (loss_dtype=float64 makes
    a float64 model exact up to float64 rounding: the oracle tests measure float32 against.)"""
    ref.rng.reset(step_seed)
    x = ref.embed(tokens)
    x.retain_grad()
    logits = ref.run_layers(x) @ ref.output_weight().t()
    loss = F.cross_entropy(logits.to(loss_dtype).flatten(0, 1), targets.flatten())
    loss.backward()
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


def pipeline_schedule(pcfg: ParallelConfig, name: str | None = None,
                      microbatches: int | None = None):
    """The pipeline Schedule verify runs, or None for the plain step (pp = virtual = 1, no name).

    Defaults: 1F1B (interleaved with virtual > 1), 2*pp micro-batches; ZB-V always has two
    chunks per rank."""
    if name is None and pcfg.pp == 1 and pcfg.virtual_pp == 1:
        return None
    name = name or ("interleaved" if pcfg.virtual_pp > 1 else "1f1b")
    virtual = 2 if name == "zb-v" and pcfg.virtual_pp == 1 else pcfg.virtual_pp
    return make_schedule(name, pcfg.pp, microbatches or 2 * pcfg.pp, virtual)


def _step(model, schedule, planted: Plant, tokens, targets, step_seed: int):
    """One step on either model: (logits [b, s, V], loss, dL/dX [b, s, h]) on every rank."""
    grid = model.grid
    if schedule is None:
        cp, layout = grid.cp, planted.cp_layout()   # context parallelism: this rank's chunks
        x, logits, loss = parallel_step(model, shard_sequence(tokens, cp.size, cp.rank, layout),
                                        shard_sequence(targets, cp.size, cp.rank, layout), step_seed,
                                        planted)
        planted.grads(model, grid)
        dx = comm.all_gather(x.grad, grid.tp, dim=1) if grid.sequence_parallel else x.grad
        logits = comm.all_gather(logits.detach(), grid.tp, dim=-1)
        if cp.size > 1:   # a rank's loss is the mean over its tokens: the reference's, averaged
            loss = comm.all_reduce(loss.detach().clone(), cp) / cp.size
            dx = unshard_sequence(dx, cp) / cp.size
            logits = unshard_sequence(logits, cp)
        return logits, loss, dx
    model.rng.reset(step_seed)
    result = run_schedule(schedule, model, tokens, targets, plant=planted)
    planted.grads(model, grid)
    return collect_outputs(result, model, *tokens.shape)


def run_rank(pcfg: ParallelConfig, mcfg: ModelConfig, steps: int, dtype: torch.dtype = torch.float32,
             seed: int = 0, lr: float = 1e-4, eps: float = 1e-6, batch: int = 2,
             seq: int | None = None, plant: str | None = None, schedule=None) -> list[Row] | None:
    """The body every rank runs; rank 0 also runs the reference and returns the rows.

    `schedule` (a pipeline Schedule, see pipeline_schedule): the model is cut into its stages
    and every step runs it with the pipeline executor; the batch is cut into its micro-batches.
    `plant` (tests only, see verify_plants.PLANTS) puts a deliberate error into the run."""
    grid = build_grid(pcfg)
    lead, seq, planted = grid.rank == 0, seq or mcfg.seq_len, Plant(plant)
    ref = GPT(mcfg, seed).to(dtype)
    placement = schedule.stage_rank if schedule is not None else None
    if schedule is None:
        model = ParallelGPT.from_reference(ref, grid)
    else:
        model = PipelineGPT.from_reference(ref, grid, placement)
    tied_across_stages = getattr(model, "tied_across_ranks", False)
    ref.to(grid.device)   # masks are drawn on the tensors' device: the same stream as the ranks'
    # The kernels' run steps with the fused AdamW kernel too; the reference never does.
    adamw = FusedAdamW if mcfg.use_kernels else torch.optim.AdamW
    opt = adamw(model.parameters(), lr=lr, eps=eps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps)
    tol = float32_tolerance(mcfg, batch, seq)
    rows: list[Row] = []
    for step in range(steps):
        tokens, targets = (t.to(grid.device) for t in make_batch(step, seed, batch, seq, mcfg.vocab_size))
        step_seed = seed * 1_000 + step       # each step's dropout masks, on both sides
        logits, loss, dx = _step(model, schedule, planted, tokens, targets, step_seed)
        # Gather what rank 0 compares (collectives: every rank takes part).
        full_logits = planted.logits(logits)
        local_grads = grads_state_dict(model)
        grads = gather_state_dict(local_grads, mcfg, grid, placement)
        grad_replicas = replica_rows(step, "grads", local_grads, mcfg, grid, tied_across_stages)
        if lead:
            ref_x, ref_logits, ref_loss = reference_step(ref, tokens, targets, step_seed)
            rows += sum_rows(step, {"logits": (full_logits, ref_logits), "loss": (loss, ref_loss),
                                    "dL/dX": (dx, ref_x.grad)}, tol)
            rows += grad_rows(step, grads, grads_state_dict(ref), tol) + grad_replicas
        # Both optimizers step on the reference's gradients: the step is checked on its own.
        ref_grads = _from_rank0({n: p.grad if lead else torch.empty_like(p)
                                 for n, p in ref.named_parameters()}, grid)
        with torch.no_grad():
            for name, shard in shard_state_dict(ref_grads, mcfg, grid, placement).items():
                model.get_parameter(name).grad.copy_(shard)
        old = gather_state_dict(model.state_dict(), mcfg, grid, placement)
        planted.before_step(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        planted.after_step(model, grid)
        weight_replicas = replica_rows(step, "weights", model.state_dict(), mcfg, grid, tied_across_stages)
        new = gather_state_dict(model.state_dict(), mcfg, grid, placement)
        if lead:
            ref_old = {n: p.detach().clone() for n, p in ref.named_parameters()}
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_new = {n: p.detach() for n, p in ref.named_parameters()}
            rows += update_rows(step, new, old, ref_new, ref_old) + weight_replicas
    return rows if lead else None


def verify(parallel_config: ParallelConfig, model_config: ModelConfig, steps: int = 3, *,
           dtype: torch.dtype = torch.float32, seed: int = 0, lr: float = 1e-4, eps: float = 1e-6,
           batch: int | None = None, seq: int | None = None, timeout: float = DEFAULT_TIMEOUT,
           plant: str | None = None, schedule: str | None = None,
           microbatches: int | None = None) -> Report:
    """Launch parallel_config.world_size ranks, compare for `steps` AdamW steps, return the report.

    With pp > 1, virtual_pp > 1 or a `schedule` name (pipeline.schedules.SCHEDULES) the model
    is cut into pipeline stages and run by the pipeline executor (see pipeline_schedule);
    `batch` defaults to one sample per micro-batch (2 without a pipeline).
    With model_config.use_kernels this process's environment may get TRITON_INTERPRET=1
    (see enable_kernels).
    """
    check_built(parallel_config)
    sched = pipeline_schedule(parallel_config, schedule, microbatches)
    check_cp(parallel_config, sched)
    if sched is not None:     # ZB-V has two chunks per rank whatever virtual_pp says
        parallel_config = dataclasses.replace(parallel_config, virtual_pp=sched.virtual)
    batch = batch or (sched.microbatches if sched is not None else 2)
    if sched is not None and batch % sched.microbatches:
        raise ValueError(f"a batch of {batch} cannot be cut into {sched.microbatches} equal "
                         f"micro-batches: use a multiple of {sched.microbatches}")
    if steps < 1 or batch < 1:
        raise ValueError(f"verify needs steps >= 1 and batch >= 1, got steps={steps}, batch={batch}")
    seq = seq or model_config.seq_len
    validate_model(parallel_config, model_config, seq)
    Plant(plant)                                      # an unknown plant fails here, not in a rank
    if model_config.dropout_rng == "per_rank" and model_config.dropout > 0:
        raise ValueError("dropout_rng='per_rank' draws masks no single device draws, so nothing can be "
                         "compared: verify with dropout_rng='exact' (the default) or dropout=0")
    if model_config.use_kernels:
        check_kernels_dtype(dtype)
        enable_kernels(model_config, parallel_config.world_size)
    rows = launch(run_rank, parallel_config, model_config, steps, dtype, seed, lr, eps, batch, seq,
                  plant, sched, world_size=parallel_config.world_size, timeout=timeout)[0]
    return Report(rows)


def check_cp(pcfg: ParallelConfig, sched) -> None:
    if pcfg.cp > 1 and sched is not None:
        raise ValueError("context parallelism inside pipeline stages is not built yet (the executor "
                         "does not split micro-batches over cp): use --cp with --pp 1, no schedule")


def check_kernels_dtype(dtype: torch.dtype) -> None:
    if dtype != torch.float32:
        raise ValueError(f"--kernels: the kernels compute in float32 (and 16-bit on a GPU), "
                         f"so comparing them in {dtype} checks nothing more: use --dtype float32")


EXAMPLES = """examples:
  python -m minitron.verify --tp 2 --sp
  python -m minitron.verify --tp 2 --sp --norm rmsnorm --activation swiglu --position rope --kv-heads 2
  python -m minitron.verify --tp 2 --sp --kernels      fused Triton kernels and FusedAdamW
  python -m minitron.verify --tp 1 --cp 2              ring attention over 2 ranks (zigzag chunks)
  python -m minitron.verify --tp 2 --sp --cp 2 --cp-variant ulysses
  python -m minitron.verify --tp 1 --pp 2 --schedule zb-h1 --microbatches 4
  python -m minitron.verify --tp 2 --sp --pp 2 --schedule 1f1b --microbatches 4
  python -m minitron.verify --tp 1 --pp 4 --virtual 2 --schedule interleaved --microbatches 8 --layers 8

exit status: 0 PASS, 1 FAIL, 2 bad options"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the examples kept line by line."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitron.verify", description=__doc__.split("\n")[0],
                                epilog=EXAMPLES, formatter_class=_HelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks launched)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages' ranks)")
    g.add_argument("--virtual", type=int, default=1, dest="virtual_pp",
                   help="model chunks (stages) per pipeline rank: interleaved schedules")
    g.add_argument("--schedule", choices=sorted(SCHEDULES), default=None,
                   help="pipeline schedule (default with --pp > 1: 1f1b, interleaved with --virtual > 1; "
                        "zb-v always has 2 chunks per rank)")
    g.add_argument("--microbatches", type=_positive, default=None,
                   help="micro-batches per step of a pipeline schedule (default 2 * pp)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size: every sequence split "
                   "over cp ranks (2*cp zigzag chunks)")
    g.add_argument("--cp-variant", choices=CP_VARIANTS, default="ring",
                   help="how attention reaches the other cp ranks' keys and values")
    for opt, field in (("--dp", "dp"), ("--ep", "ep")):
        g.add_argument(opt, type=int, default=1, dest=field, help=f"{UNBUILT[field][0]} (not built yet)")
    r = p.add_argument_group("run")
    r.add_argument("--steps", type=_positive, default=3)
    r.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    r.add_argument("--eps", type=float, default=1e-6, help="AdamW eps (see the module docstring)")
    r.add_argument("--batch", type=_positive, default=None,
                   help="sequences per step (default: one per micro-batch with a pipeline, else 2)")
    r.add_argument("--kernels", action="store_true",
                   help="the split model uses minitron.kernels (fused Triton norms, attention, MLP "
                        "activations, loss) and FusedAdamW; on CPU ranks through the Triton "
                        "interpreter (TRITON_INTERPRET=1, set here; a few seconds at the default shape)")
    r.add_argument("--plant", default=None, help=argparse.SUPPRESS)   # tests: verify_plants.PLANTS
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: heads)")
    m.add_argument("--seq", type=int, default=16)
    m.add_argument("--vocab", type=int, default=128)
    m.add_argument("--norm", choices=CHOICES["norm"], default="layernorm")
    m.add_argument("--activation", choices=CHOICES["activation"], default="gelu")
    m.add_argument("--position", choices=CHOICES["position"], default="learned")
    m.add_argument("--dropout", type=float, default=0.1)
    m.add_argument("--tie", action="store_true", help="tie the output layer to the embedding")
    m.add_argument("--no-bias", action="store_true", help="no biases on the linear layers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        pcfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep,
                              virtual_pp=args.virtual_pp, sequence_parallel=args.sp,
                              cp_variant=args.cp_variant)
        check_built(pcfg)
        sched = pipeline_schedule(pcfg, args.schedule, args.microbatches)
        check_cp(pcfg, sched)
        if sched is not None:
            pcfg = dataclasses.replace(pcfg, virtual_pp=sched.virtual)
        batch = args.batch or (sched.microbatches if sched is not None else 2)
        if sched is not None and batch % sched.microbatches:
            raise ValueError(f"--batch {batch} cannot be cut into {sched.microbatches} equal "
                             f"micro-batches: use a multiple of {sched.microbatches}")
        mcfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
                           n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                           norm=args.norm, activation=args.activation, position=args.position,
                           dropout=args.dropout, tie_embeddings=args.tie, bias=not args.no_bias,
                           use_kernels=args.kernels)
        validate_model(pcfg, mcfg)
        Plant(args.plant)
        dtype = getattr(torch, args.dtype)
        kernels = "kernels=off (plain torch ops)"
        if args.kernels:
            check_kernels_dtype(dtype)
            kernels = enable_kernels(mcfg, pcfg.world_size)   # before anything imports triton
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pipeline = "" if sched is None else (f"\nschedule={sched.name} microbatches={sched.microbatches} "
                                         f"virtual={sched.virtual} stage_rank={sched.stage_rank}")
    print(f"{pcfg}\n{mcfg}\nbatch={batch} steps={args.steps} dtype={args.dtype} seed={args.seed} "
          f"lr={args.lr} eps={args.eps}\n{kernels}{pipeline}")
    report = verify(pcfg, mcfg, args.steps, dtype=dtype, seed=args.seed, lr=args.lr, eps=args.eps,
                    batch=batch, plant=args.plant, schedule=args.schedule,
                    microbatches=args.microbatches)
    print(report.table())
    print(report.verdict())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
