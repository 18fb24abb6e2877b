"""The set-up files agree with each other, so conda and pip users get the same course; the tests
run with or without pytest-xdist."""
import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!;\s\[]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_name(r) for r in extra}
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    listed = {_name(line.strip()[2:]) for line in pip_section.splitlines()
              if line.strip().startswith("- ")}
    assert listed == wanted, f"only in pyproject: {wanted - listed}; only in environment.yml: {listed - wanted}"


def test_torch_requirement_stays_a_floor():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch>=2.4" in project["dependencies"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci


def test_nothing_depends_on_the_shared_folder():
    offenders = []
    for path in ROOT.rglob("*"):
        if ".venv" in path.parts or ".git" in path.parts or not path.is_file() or path == pathlib.Path(__file__):
            continue
        if path.suffix in {".py", ".ipynb", ".toml", ".yml", ".cfg"} or path.name in {"Makefile", "run"}:
            if "../shared" in path.read_text(errors="ignore") or "/shared/seeds" in path.read_text(errors="ignore"):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_the_tests_run_without_xdist(request):
    """tests/conftest.py sets `-n auto`'s worker count through one of xdist's hooks, marked
    optional: a pytest without xdist (`-p no:xdist`, or not installed) still runs the tests
    instead of stopping at an unknown hook. Checked as pytest checks its plugins (check_pending:
    every hook must have a spec, unless optional), against pytest's own specs, xdist's not added."""
    conftest = request.config.pluginmanager.get_plugin(str(ROOT / "tests" / "conftest.py"))
    assert conftest is not None, "tests/conftest.py is not registered under its path"
    without_xdist = pytest.PytestPluginManager()
    without_xdist.register(conftest, name="tests/conftest.py")
    without_xdist.check_pending()
