"""The table shown: as lines, as the README's markdown (`python -m minitron.refusals
--readme README.md`), and each row's example command line turned back into Options."""
from __future__ import annotations

from .options import Options
from .refused import FLAGS, _name
from .table import TABLE, Refusal


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
