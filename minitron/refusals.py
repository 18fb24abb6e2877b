"""Every combination of options minitron refuses, in one table: which options, why, what works.

    refusals.check(Options.of(pcfg, mcfg, dtype, zero, schedule, fp8), level="engine")

Each option here works on its own; a row names options that do not run (or cannot be compared
with one device) together. The engine (train/engine.py check_supported), the models' builders
(level "model"), both command lines (before any rank starts), `verify --matrix` (its refused
rows) and the README's list (`python -m minitron.refusals --readme README.md` writes it; tests/
test_refusals.py checks it) all read this table, so no two places can disagree.

A row's level says who refuses it:
  model    the split model cannot be built on this grid (ParallelGPT, PipelineGPT, ParallelMoE)
  engine   the engine does not train it (TrainingRun, python -m minitron.train)
  verify   the engine trains it, but the verifier cannot compare it with one device number for
           number (python -m minitron.verify)
Each row's fixes are other values that do run, rendered as flags on a command line and as
fields from Python (like model/config.py's ConfigError); tests/test_refusals.py checks that each fix
passes the table, and that each row's example is refused by both command lines.

Not here: a value out of range or a size that does not divide (ModelConfig, ParallelConfig,
model/splits.py, the flags' own checks) and a flag that means nothing without another (--sp
without tp > 1, --fp8-recipe without --dtype fp8): those are bad input, not combinations.
This module imports nothing from minitron, so every floor may read it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

LEVELS = ("model", "engine", "verify")
SIXTEEN_BIT = ("bfloat16", "float16")
V_SHAPED = ("zb-v", "dualpipev")      # the first and the last stage on one rank (pipeline/schedules.py)


@dataclass(frozen=True)
class Options:
    """What a run combines, in ParallelConfig's and ModelConfig's field names. The defaults are a
    plain single-device float32 run. dtype is --dtype's name (fp8: bfloat16 with FP8 GEMMs);
    schedule a pipeline schedule's name or None; zero None: no data-parallel engine asked for."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_pp: int = 1
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    cp_variant: str = "ring"
    dp_shard: int | None = None
    n_experts: int = 0
    capacity_factor: float | None = None
    aux_loss_scope: str = "global"
    tie_embeddings: bool = False
    recompute: str = "none"
    use_kernels: bool = False
    dropout_rng: str = "exact"
    dtype: str = "float32"
    fp8_recipe: str | None = None
    fp8_amax_unreduced: bool = False      # --no-fp8-amax-reduce (FP8Recipe.reduce_amax off)
    zero: int | None = None
    schedule: str | None = None
    reference_routing: bool = False

    @classmethod
    def of(cls, pcfg=None, mcfg=None, dtype=None, zero=None, schedule=None, fp8=None,
           reference_routing: bool = False) -> "Options":
        """From the engine's arguments: a ParallelConfig, a ModelConfig, a torch dtype, the
        ZeRO stage, a Schedule (or its name) and an FP8Recipe; any of them left out: the default."""
        o = {}
        if pcfg is not None:
            o.update(tp=pcfg.tp, pp=pcfg.pp, dp=pcfg.dp, cp=pcfg.cp, ep=pcfg.ep,
                     virtual_pp=pcfg.virtual_pp, sequence_parallel=pcfg.sequence_parallel,
                     tp_comm_overlap=pcfg.tp_comm_overlap, cp_variant=pcfg.cp_variant,
                     dp_shard=pcfg.dp_shard)
        if mcfg is not None:                  # a ModelConfig, or anything with its fields
            get = lambda name, default: getattr(mcfg, name, default)   # noqa: E731
            o.update(n_experts=get("n_experts", 0), capacity_factor=get("capacity_factor", None),
                     aux_loss_scope=get("aux_loss_scope", "global"),
                     tie_embeddings=get("tie_embeddings", False), recompute=get("recompute", "none"),
                     use_kernels=get("use_kernels", False),
                     dropout_rng=get("dropout_rng", "exact") if get("dropout", 0) > 0 else "exact")
        if dtype is not None:
            o["dtype"] = str(dtype).removeprefix("torch.")
        if fp8 is not None:                   # FP8 GEMMs in bfloat16 training: --dtype fp8
            o.update(fp8_recipe=fp8.scaling, fp8_amax_unreduced=not getattr(fp8, "reduce_amax", True),
                     dtype="fp8" if o.get("dtype", "bfloat16") == "bfloat16" else o["dtype"])
        if schedule is not None:
            o["schedule"] = schedule if isinstance(schedule, str) else schedule.name
        return cls(**o, zero=zero, reference_routing=reference_routing)

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None or self.pp > 1 or self.virtual_pp > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_shard is not None and self.dp_shard < self.dp

    @property
    def fp8(self) -> bool:
        return self.fp8_recipe is not None

    @property
    def engine(self) -> bool:
        """Whether the run steps through a data-parallel engine (train/engine.py uses_engine)."""
        return self.dp > 1 or self.ep > 1 or self.zero is not None or \
            self.dtype in (*SIXTEEN_BIT, "fp8")

    def with_(self, **changes) -> "Options":
        """These options changed (a fix); a pipeline's schedule goes with the pipeline."""
        new = dataclasses.replace(self, **changes)
        if new.dtype != "fp8" and "fp8_recipe" not in changes:     # out of FP8: no recipe
            new = dataclasses.replace(new, fp8_recipe=None, fp8_amax_unreduced=False)
        if new.pp == 1 and new.virtual_pp == 1 and "schedule" not in changes:
            new = dataclasses.replace(new, schedule=None)
        return new


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


class Refused(ValueError):
    """A refused combination: names the options (`--flag value` through as_flags, for a command
    line; `field=value` as str, for Python), why, and options that work (its fixes)."""

    def __init__(self, name: str, template: str, values: dict, fixes=()):
        self.name, self.template, self.values = name, template, dict(values)
        self.fixes = [dict(f) for f in fixes]
        super().__init__(self._render(None))

    def __reduce__(self):                 # picklable: a rank may send one back
        return type(self), (self.name, self.template, self.values, self.fixes)

    def as_flags(self, flags: dict[str, str] | None = None) -> str:
        return self._render({**FLAGS, **(flags or {})})

    def fixes_text(self, flags: dict[str, str] | None = None) -> str:
        return " or ".join(" ".join(_name(f, v, flags, fix=True) for f, v in fix.items())
                           for fix in self.fixes)

    def _render(self, flags: dict[str, str] | None) -> str:
        text = self.template.format(**{f: _name(f, v, flags) for f, v in self.values.items()})
        return text + ("; use " + self.fixes_text(flags) if self.fixes else "")


def _name(field: str, value, flags: dict[str, str] | None, fix: bool = False) -> str:
    """`--flag value` (a switch alone; False or None: `drop --flag` in a fix), or `field=value`."""
    flag = None if flags is None else flags.get(field)
    if flag is None:
        return f"{field}={value!r}"
    if value is True:
        return flag
    if value is False or value is None:
        return f"drop {flag}" if fix else f"no {flag}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


# Options' fields -> the flags both command lines give them
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "ep": "--ep",
         "virtual_pp": "--virtual", "sequence_parallel": "--sp",
         "tp_comm_overlap": "--tp-comm-overlap", "cp_variant": "--cp-variant",
         "dp_shard": "--dp-shard", "n_experts": "--experts", "capacity_factor": "--capacity-factor",
         "aux_loss_scope": "--aux-loss-scope",
         "tie_embeddings": "--tie", "recompute": "--recompute", "use_kernels": "--kernels",
         "dtype": "--dtype", "fp8_recipe": "--fp8-recipe", "zero": "--zero",
         "fp8_amax_unreduced": "--no-fp8-amax-reduce",
         "schedule": "--schedule", "reference_routing": "--reference-routing"}


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
    _row("fp8-experts", "engine", ("dtype", "n_experts"),
         lambda o: o.fp8 and o.n_experts,
         "the expert GEMMs (moe/experts.py's batched matmuls) are not FP8 GEMMs yet: an FP8 "
         "run would cast the dense layers only",
         [{"dtype": "bfloat16"}, {"dtype": "float32"}], "--tp 1 --ep 2 --experts 4 --dtype fp8"),
    _row("fp8-tp-comm-overlap", "engine", ("dtype", "tp_comm_overlap"),
         lambda o: o.fp8 and o.tp_comm_overlap,
         "the ring's chunked GEMMs (tensor_parallel/overlap.py) are not FP8 GEMMs yet",
         [{"tp_comm_overlap": False}, {"dtype": "bfloat16"}],
         "--tp 2 --sp --tp-comm-overlap --dtype fp8"),
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


def markdown() -> str:
    """The table as the README shows it (between its refusals markers)."""
    lines = ["| refused | level | why | what works instead |", "|---|---|---|---|"]
    for r in TABLE:
        err = r.error(_example_options(r))
        what = " ".join(r.example) if r.example else \
            ", ".join(_name(f, v, None) for f, v in err.values.items()) + " (Python)"
        lines.append(f"| `{what}` | {r.level} | {r.why} | {err.fixes_text(FLAGS)} |")
    return "\n".join(lines)


def _example_options(r: Refusal) -> Options:
    """Options that the row refuses: its example's, or the first fix's field values turned."""
    if r.example is None:
        return Options(**{f: v for f, v in _PYTHON_EXAMPLES[r.name].items()})
    return example_options(r.example)


_PYTHON_EXAMPLES = {"fp8-not-in-bfloat16": {"dtype": "float16", "fp8_recipe": "delayed"},
                    "float64-engine": {"dtype": "float64", "dp": 2},
                    "per-rank-dropout": {"dropout_rng": "per_rank"},
                    "reference-routing-without-experts": {"reference_routing": True}}


def example_options(argv) -> Options:
    """The Options a command line's flags give (only the flags of this table; the rest default).
    For the README and the tests; the command lines themselves build a ParallelConfig and a
    ModelConfig and call Options.of."""
    flag_to = {v: k for k, v in FLAGS.items()}
    o, i = {}, 0
    argv = list(argv)
    while i < len(argv):
        name = flag_to.get(argv[i])
        kind = Options.__dataclass_fields__[name].type if name else None
        if name is None:
            i += 1 if i + 1 >= len(argv) or argv[i + 1].startswith("--") else 2
            continue
        if kind == "bool":
            o[name], i = True, i + 1
            continue
        value = argv[i + 1]
        o[name] = int(value) if kind in ("int", "int | None") else \
            float(value) if kind == "float | None" else value
        i += 2
    if o.get("dtype") == "fp8":
        o.setdefault("fp8_recipe", "delayed")
    return Options(**o)


BEGIN, END = "<!-- refusals: python -m minitron.refusals --readme README.md -->", "<!-- end refusals -->"


def with_table(readme: str) -> str:
    """`readme` with markdown() between its BEGIN and END markers."""
    head, rest = readme.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{markdown()}\n{END}{rest.split(END, 1)[1]}"


def main(argv=None) -> int:
    """python -m minitron.refusals [--markdown | --readme README.md]: the table, as lines, as
    markdown, or written into a README between its markers."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--markdown"]:
        print(markdown())
    elif args[:1] == ["--readme"] and len(args) == 2:
        with open(args[1]) as f:
            text = f.read()
        with open(args[1], "w") as f:
            f.write(with_table(text))
    elif args:
        print("usage: python -m minitron.refusals [--markdown | --readme README.md]", file=sys.stderr)
        return 2
    else:
        for r in TABLE:
            print(f"{r.name:<34} {r.level:<6}  {r.error(_example_options(r)).as_flags()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
