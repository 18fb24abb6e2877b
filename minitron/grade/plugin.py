"""The pytest plugin that `python -m minitron.grade` runs nbval with.

nbval says only "cell N failed" with a coloured diff. The grader needs to know, for every
code cell, whether it passed and, if not, how: the exception the cell raised (name, message,
traceback) or the first output line that differs from the reference. This plugin writes that
to the JSON file named by $MINITRON_GRADE_RECORD:

    {notebook path: {code cell number: {"outcome": "passed" | "failed" | "skipped",
                                        "message",  # failed: nbval's first line (timeouts, diffs)
                                        "ename", "evalue", "traceback",   # when it raised
                                        "expected", "got"}}}              # text of both outputs

It also starts each notebook's kernel in the folder named for it in $MINITRON_GRADE_CWD
(a JSON map: folder of the graded copy -> folder of the learner's notebook), so relative
paths behave as they did when the learner ran the notebook there.

It imports nothing of minitron: the grader copies it beside the graded notebooks and loads it
as a module of its own, so that nbval's process, which runs no cell, does not import the
minitron package and with it torch (seconds per grading).
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

# nbformat validates with jsonschema, which compiles a grammar for the "iri" string format at
# import when rfc3987_syntax is installed: 2.5 s of CPU per grading, for a format no notebook
# schema uses. Hide it before nbval imports nbformat (jsonschema then skips that format).
sys.modules.setdefault("rfc3987_syntax", None)

try:
    from nbval import plugin as _nbval
except ImportError:  # pragma: no cover - grade.py reports a missing nbval when no record is written
    _nbval = None

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_records: dict[str, dict[int, dict]] = {}


def _learner_folder(cwd: str) -> str:
    return json.loads(os.environ.get("MINITRON_GRADE_CWD", "{}")).get(os.path.realpath(cwd), cwd)


if _nbval is not None and hasattr(_nbval, "RunningKernel"):
    _RunningKernel = _nbval.RunningKernel

    def _kernel_in_learner_folder(kernel_name, cwd=None, *args, **kwargs):
        return _RunningKernel(kernel_name, _learner_folder(cwd) if cwd else cwd, *args, **kwargs)

    _nbval.RunningKernel = _kernel_in_learner_folder


def output_text(outputs) -> str:
    """What a learner would read in a cell's output area: streams and plain-text results."""
    parts = []
    for out in outputs or []:
        kind = out.get("output_type")
        if kind == "stream":
            text = out.get("text", "")
            parts.append("".join(text) if isinstance(text, list) else text)
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            text = data.get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            parts.append((text or "<" + ", ".join(sorted(data)) + ">") + "\n")
        elif kind == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}\n")
    return "".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not hasattr(item, "cell_num") or (report.when != "call" and not report.failed):
        return  # not a notebook cell, or a set-up/tear-down phase that went well
    record = {"outcome": "skipped" if report.skipped else report.outcome}
    if report.failed:
        message = _ANSI.sub("", str(call.excinfo.value)) if call.excinfo else ""
        record["message"] = message.splitlines()[0] if message else ""
        outputs = getattr(item, "test_outputs", None) or []
        errors = [o for o in outputs if o.get("output_type") == "error"]
        if errors:
            record.update(ename=errors[-1].get("ename", ""), evalue=errors[-1].get("evalue", ""),
                          traceback=[_ANSI.sub("", t) for t in errors[-1].get("traceback", [])])
        else:
            record.update(expected=output_text(item.cell.get("outputs")), got=output_text(outputs))
    _records.setdefault(str(item.parent.path), {})[item.cell_num] = record


def pytest_sessionfinish(session):
    path = os.environ.get("MINITRON_GRADE_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump(_records, f, indent=1)
