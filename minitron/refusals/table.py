"""The table itself: one row per refused combination, and the lookups every floor calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .options import LEVELS, V_SHAPED, Options
from .refused import Refused


@dataclass(frozen=True)
class Refusal:
    """One row: `fields` refused together when `applies`, `why`, and `fixes` that run instead."""
    name: str
    level: str
    fields: tuple[str, ...]
    applies: Callable[[Options], bool]
    why: str
    fixes: tuple[dict, ...]
    example: tuple[str, ...] | None     # argv both command lines refuse (None: Python only)

    def error(self, o: Options) -> "Refused":
        template = " with ".join("{%s}" % f for f in self.fields) + ": " + self.why
        values = {f: getattr(o, f) for f in self.fields}
        works = [fix for fix in self.fixes if refusal(o.with_(**fix), self.level) is None]
        return Refused(self.name, template, values, works or self.fixes)


def _row(name, level, fields, applies, why, fixes, example):
    return Refusal(name, level, tuple(fields), applies, why, tuple(fixes),
                   None if example is None else tuple(example.split()))


TABLE: tuple[Refusal, ...] = (
    # ---- the model cannot be built --------------------------------------------------------------
    _row("ep-without-experts", "model", ("ep", "n_experts"),
         lambda o: o.ep > 1 and not o.n_experts,
         "expert parallelism splits the experts of MoE layers, and a dense model has none",
         [{"n_experts": 4}, {"ep": 1}], "--tp 1 --ep 2"),
    _row("experts-tp-without-sp", "model", ("n_experts", "tp", "sequence_parallel"),
         lambda o: o.n_experts and o.tp > 1 and not o.sequence_parallel,
         "the dispatcher sends each token from the one rank of tp x ep that holds it; without "
         "SP every tp rank holds every token (Megatron-Core asserts the same)",
         [{"sequence_parallel": True}, {"tp": 1}], "--tp 2 --ep 2 --experts 4"),
    _row("capacity-with-cp", "model", ("capacity_factor", "cp"),
         lambda o: o.capacity_factor is not None and o.cp > 1,
         "the per-sequence capacity would need each expert's counts across the zigzag chunks of "
         "the other cp ranks, before any token is dropped",
         [{"capacity_factor": None}, {"cp": 1}],
         "--tp 1 --cp 2 --ep 2 --experts 4 --capacity-factor 1.0"),
    _row("selective-recompute-with-cp", "model", ("recompute", "cp"),
         lambda o: o.recompute == "selective" and o.cp > 1,
         "selective recomputation of context-parallel attention is not built (the core to rerun "
         "spans the ring's or all-to-all's exchange)",
         [{"recompute": "full"}, {"recompute": "none"}, {"cp": 1}],
         "--tp 1 --cp 2 --recompute selective"),
    # ---- the engine does not train it -----------------------------------------------------------
    _row("fp8-not-in-bfloat16", "engine", ("dtype",),
         lambda o: o.fp8 and o.dtype != "fp8",
         "FP8 GEMMs run inside bfloat16 training (bf16 activations, fp32 master weights)",
         [{"dtype": "bfloat16"}], None),
    _row("float64-engine", "engine", ("dtype",),
         lambda o: o.dtype == "float64" and o.engine,
         "the data-parallel engine (dp > 1, ep > 1, a ZeRO stage or 16 bits) steps float32 master "
         "weights (ZeroOptimizer)",
         [{"dtype": "float32"}, {"dtype": "bfloat16"}, {"dtype": "float16"}], None),
    _row("hsdp-without-zero", "engine", ("dp_shard", "zero"),
         lambda o: o.hsdp and not o.zero,
         "HSDP shards ZeRO's state over dp_shard of the dp ranks, and ZeRO 0 shards nothing",
         [{"zero": 1}, {"zero": 3}, {"dp_shard": None}], "--tp 1 --dp 4 --dp-shard 2 --zero 0"),
    _row("tie-zero3-v-schedule", "engine", ("schedule", "tie_embeddings", "zero"),
         lambda o: o.zero == 3 and o.tie_embeddings and o.schedule in V_SHAPED and o.engine,
         "a V schedule puts the first and the last stage on one rank, so the one tied weight's two "
         "uses (lookup, output layer) interleave across micro-batches; ZeRO-3 keeps a tied weight "
         "gathered from the lookup to its reduce, which only micro-batches run one after the other "
         "allow (across ranks each copy is a unit of its own: --schedule 1f1b works)",
         [{"schedule": "1f1b"}, {"tie_embeddings": False}, {"zero": 1}],
         "--tp 1 --pp 2 --schedule zb-v --microbatches 4 --layers 4 --tie --dp 2 --zero 3"),
    _row("float16-pipeline", "engine", ("dtype", "pp"),
         lambda o: o.dtype == "float16" and o.pipelined and o.engine,
         "the pipeline executor takes no loss scale (its backward would need the scaled loss on "
         "the last stage and the unscale after the last micro-batch)",
         [{"dtype": "bfloat16"}, {"pp": 1}], "--tp 1 --pp 2 --dtype float16"),
    # ---- the engine trains it, the verifier cannot compare it -----------------------------------
    _row("kernels-not-float32", "verify", ("use_kernels", "dtype"),
         lambda o: o.use_kernels and o.dtype != "float32",
         "the kernels compute in float32 (and 16-bit on a GPU), so comparing them in another "
         "dtype checks nothing more",
         [{"dtype": "float32"}], "--tp 1 --kernels --dtype bfloat16"),
    _row("fp8-amax-unreduced", "verify", ("fp8_amax_unreduced",),
         lambda o: o.fp8 and o.fp8_amax_unreduced and o.tp * o.cp * o.dp * o.ep > 1,
         "each rank scales its own piece of every FP8 tensor by its own amax, so its casts are "
         "numbers no single device casts, and their difference cannot be told from a bug",
         [{"fp8_amax_unreduced": False}], "--tp 2 --dtype fp8 --no-fp8-amax-reduce"),
    _row("per-rank-dropout", "verify", ("dropout_rng",),
         lambda o: o.dropout_rng == "per_rank",
         "Megatron's per-rank dropout seeds draw masks no single device draws, so nothing can be "
         "compared", [{"dropout_rng": "exact"}], None),
    _row("reference-routing-without-experts", "verify", ("reference_routing", "n_experts"),
         lambda o: o.reference_routing and not o.n_experts,
         "--reference-routing imposes the reference's expert choices on the routers of MoE layers, "
         "and a dense model has none", [{"n_experts": 4}, {"reference_routing": False}], None),
    _row("capacity-pipeline", "verify", ("capacity_factor", "pp"),
         lambda o: o.capacity_factor is not None and o.pipelined,
         "a capacity factor drops tokens micro-batch by micro-batch, and verify compares the "
         "drops of the whole batch", [{"capacity_factor": None}, {"pp": 1}],
         "--tp 1 --pp 2 --ep 2 --experts 4 --capacity-factor 1.0"),
    _row("replica-aux-loss-split", "verify", ("aux_loss_scope", "dp", "ep"),
         lambda o: o.n_experts and o.aux_loss_scope == "replica" and o.dp * o.ep > 1,
         "each dp x ep replica balances its own tokens, an objective the one device (a single "
         "replica) does not have", [{"aux_loss_scope": "global"}],
         "--tp 1 --ep 2 --experts 4 --aux-loss-scope replica"),
)
BY_NAME = {r.name: r for r in TABLE}


def refusal(o: Options, level: str = "verify") -> Refusal | None:
    """The first row that refuses `o` at `level` or below (model < engine < verify), or None."""
    upto = LEVELS[:LEVELS.index(level) + 1]
    return next((r for r in TABLE if r.level in upto and r.applies(o)), None)


def check(o: Options, level: str = "verify") -> None:
    """Raise Refused for the first row that refuses `o` (see refusal)."""
    row = refusal(o, level)
    if row is not None:
        raise row.error(o)


def check_model(pcfg, mcfg) -> None:
    """What a split model's builder refuses: the rows of level model."""
    check(Options.of(pcfg, mcfg), "model")
