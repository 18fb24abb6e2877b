"""The one refusal table (minitron/refusals/): every row refused by both command lines before a
rank starts, its fixes accepted, the README's list equal to it, and no refusal of a combination
of options anywhere else in the package."""
import ast
import pathlib
import pickle
import shutil

import pytest
import torch

from minitron import refusals
from minitron.grid import ParallelConfig
from minitron.config import ModelConfig
from minitron.pipeline.schedules import SCHEDULES, make_schedule
from minitron.refusals import TABLE, Refused
from minitron.train import cli as train_cli
from minitron.train.engine import check_supported
from minitron.verify import cli as verify_cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = [r for r in TABLE if r.example is not None]


class Launched(Exception):
    """A rank would have started: the options passed every check."""


@pytest.fixture
def no_ranks(monkeypatch):
    def launched(*args, **kwargs):
        raise Launched
    monkeypatch.setattr("minitron.verify.run.launch", launched)
    monkeypatch.setattr("minitron.train.restart.launch", launched)
    # --kernels would set TRITON_INTERPRET in this worker for every later test, and refuse where
    # an earlier test imported the kernels compiled: that is this process's environment, not the
    # options this file checks (tests/test_kernels.py checks it)
    monkeypatch.setattr("minitron.train.flags.enable_kernels", lambda *a: "")
    monkeypatch.setattr("minitron.verify.cli.enable_kernels", lambda *a: "")


@pytest.mark.parametrize("row", EXAMPLES, ids=lambda r: r.name)
def test_each_row_is_refused_by_both_command_lines_in_one_line(row, no_ranks, tmp_path, capfd):
    """Its own line (the flags, why, what works), exit 2, no rank started; a verify row only by
    the verifier: the trainer runs it."""
    line = row.error(refusals.example_options(row.example)).as_flags()
    assert verify_cli.main(list(row.example)) == 2
    err = capfd.readouterr().err
    assert err == f"error: {line}\n", err
    train = [*row.example, "--out", str(tmp_path / "run"), "--steps", "1"]
    if row.level == "verify":
        with pytest.raises(Launched):
            train_cli.main(train)
    else:
        assert train_cli.main(train) == 2
        assert capfd.readouterr().err == f"minitron.train: error: {line}\n"


@pytest.mark.parametrize("row", TABLE, ids=lambda r: r.name)
def test_every_fix_a_row_offers_passes_the_table(row):
    o = refusals._example_options(row)
    assert row.applies(o) and refusals.refusal(o) is row
    assert row.fixes
    for fix in row.fixes:
        assert refusals.refusal(o.with_(**fix)) is None, (row.name, fix)


@pytest.mark.parametrize("row", EXAMPLES, ids=lambda r: r.name)
def test_a_fix_runs_from_the_command_line(row, no_ranks, tmp_path, capsys):
    """The first fix, typed as the line says, gets past every check of the verifier."""
    fix = row.fixes[0]
    argv = list(row.example)
    for field, value in fix.items():
        flag = refusals.FLAGS[field]
        i = argv.index(flag) if flag in argv else None
        if i is not None:
            takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            del argv[i:i + 1 + takes]
        if value is True:
            argv.append(flag)
        elif value not in (False, None):
            argv += [flag, str(value)]
    if "--pp" in argv and argv[argv.index("--pp") + 1] == "1" and "--schedule" in argv:
        i = argv.index("--schedule")
        del argv[i:i + 2]
    with pytest.raises(Launched):
        verify_cli.main(argv)
    capsys.readouterr()


def test_the_readme_lists_the_table():
    readme = (ROOT / "README.md").read_text()
    assert refusals.BEGIN in readme
    assert refusals.with_table(readme) == readme, "run: python -m minitron.refusals --readme README.md"


def test_v_shaped_names_the_schedules_with_the_first_and_last_stage_on_one_rank():
    from minitron.pipeline.schedules import V_SHAPED
    assert set(refusals.V_SHAPED) == set(V_SHAPED)
    for name in SCHEDULES:
        placement = make_schedule(name, 2, 4).stage_rank
        assert (placement[0] == placement[-1]) == (name in refusals.V_SHAPED), name


def test_the_engine_refuses_from_the_table_naming_fields_from_python():
    with pytest.raises(Refused) as e:
        check_supported(ParallelConfig(tp=1, pp=2, dp=2), ModelConfig(tie_embeddings=True),
                        torch.float16, 1, make_schedule("1f1b", 2, 4))
    assert e.value.name == "float16-pipeline"
    assert str(e.value).startswith("dtype='float16' with pp=2: ")
    back = pickle.loads(pickle.dumps(e.value))       # a rank may send one back
    assert str(back) == str(e.value) and back.as_flags() == e.value.as_flags()


def test_fp8_with_experts_is_no_longer_refused():
    """The experts' GEMMs are FP8 GEMMs now (tensor_parallel/fp8_batched.py, tests/test_fp8_experts.py)."""
    from minitron.tensor_parallel.fp8 import FP8Recipe
    assert "fp8-experts" not in refusals.BY_NAME
    check_supported(ParallelConfig(ep=2), ModelConfig(n_experts=4), torch.bfloat16, None, None, FP8Recipe())
    check_supported(ParallelConfig(tp=2, sequence_parallel=True, ep=2, dp=2), ModelConfig(n_experts=4),
                    torch.bfloat16, 3, None, FP8Recipe("current"))


def test_a_model_builder_refuses_its_rows():
    from minitron.model.splits import validate_model
    with pytest.raises(Refused, match=r"^n_experts=4 with tp=2 with sequence_parallel=False: .*; use sequence_parallel=True or tp=1$") as e:
        validate_model(ParallelConfig(tp=2, ep=2), ModelConfig(n_experts=4))
    assert e.value.name == "experts-tp-without-sp"


# ---- no refusal of a combination outside the table ----------------------------------------------
# The options a row combines, under the names the package's code gives them.
FEATURES = {"n_experts": "experts", "experts": "experts", "zero": "zero", "zero_stage": "zero",
            "tie_embeddings": "tie", "tie": "tie", "schedule": "schedule", "sched": "schedule",
            "fp8": "fp8", "fp8_recipe": "fp8", "recompute": "recompute",
            "tp_comm_overlap": "overlap", "capacity_factor": "capacity", "use_kernels": "kernels",
            "kernels": "kernels", "dropout_rng": "dropout_rng", "reference_routing": "routing",
            "dp_shard": "hsdp", "dp_replicate": "hsdp", "dtype": "dtype", "n_stages": "pipeline"}


def _features(node: ast.AST) -> set[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    names |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {FEATURES[n] for n in names if n in FEATURES}


def refusals_outside_the_table(root: pathlib.Path = ROOT) -> list[str]:
    """Each `if` that raises on a test naming two options a refusal could combine (or one,
    inside a test already naming another), outside minitron/refusals/."""
    found = []
    for path in sorted((root / "minitron").rglob("*.py")):
        if path.parent == root / "minitron" / "refusals":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body) \
                    and len(_features(node.test)) >= 2:
                found.append(f"{path.relative_to(root)}:{node.lineno} {sorted(_features(node.test))}")
    return found


def test_no_refusal_of_a_combination_lives_outside_the_table():
    assert refusals_outside_the_table() == []
    for gone in ("fp8_refusal", "dtype_refusal", "check_moe_grid", "check_kernels_dtype"):
        hits = [p for p in (ROOT / "minitron").rglob("*.py") if f"def {gone}(" in p.read_text()]
        assert hits == [], (gone, hits)


def test_the_scan_finds_a_refusal_planted_outside_the_table(tmp_path):
    """A test of the test: an engine-style refusal written elsewhere is caught. Planted in a copy:
    a file added to the package itself would be seen by tests running beside this one
    (test_layering's floors)."""
    shutil.copytree(ROOT / "minitron", tmp_path / "minitron", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "minitron" / "_planted_refusal_for_test.py").write_text(
        "def f(mcfg, zero):\n    if mcfg.n_experts and zero == 3:\n        raise ValueError('no')\n")
    assert refusals_outside_the_table(tmp_path) == ["minitron/_planted_refusal_for_test.py:2 ['experts', 'zero']"]
