"""The pytest plugin that `python -m minitron.grade` runs nbval with.

The grader (the parent) hands it, on a pipe read once at start-up and closed before any kernel
starts (`--minitron-config-fd`), a JSON object: where to write the record, the key that signs
it, and per graded copy's folder the learner's folder and the names the exercise asks for.
Nothing of it is in the environment, on a command line or in a file a kernel can read.

It records, for every code cell, whether it passed and, if not, how: the exception the cell
raised (name, message, traceback) or the output that differs from the reference:

    {notebook path: {code cell number: {"outcome": "passed" | "failed" | "skipped",
                                        "message",  # failed: the first line (timeouts, diffs)
                                        "ename", "evalue", "traceback",   # when it raised
                                        "expected", "got"}}}              # text of both outputs

and writes it at the end signed with HMAC-SHA256 (first line: the hex MAC, then the JSON):
a kernel that writes the file itself cannot make the parent believe it.

Each notebook's kernel starts in the learner's folder, with the environment cleaned of
pytest's variables, and with `_kernel_guard` installed (see its docstring): every check cell
runs in the grader's own namespace with the kernel's own builtins and IPython machinery.
A kernel that dies is noticed within a second (`KernelDied`), not at the cell's timeout.

It imports nothing of minitron: the grader copies it beside the graded notebooks and loads it
as a module of its own, so that nbval's process, which runs no cell, does not import the
minitron package and with it torch (seconds per grading).
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import os
import re
import sys
import time
from queue import Empty

import pytest

# nbformat validates with jsonschema, which compiles a grammar for the "iri" string format at
# import when rfc3987_syntax is installed: 2.5 s of CPU per grading, for a format no notebook
# schema uses. Hide it before nbval imports nbformat (jsonschema then skips that format).
sys.modules.setdefault("rfc3987_syntax", None)

try:
    from nbval import kernel as _nbval_kernel
    from nbval import plugin as _nbval
except ImportError:  # pragma: no cover - grade/cli.py reports a missing nbval when no record is written
    _nbval = None

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_records: dict[str, dict[int, dict]] = {}
_config: dict = {}
CHECK_MARK = "# {token} check"   # the last line added to every check cell's source


class KernelDied(RuntimeError):
    """The kernel's process ended while a cell ran."""


def _kernel_guard(token: str, learner_names: list[str]) -> None:
    """Installed in each kernel before its first cell (sent as source, run once, then deleted).

    Answer cells run in the learner's namespace, as in the notebook. A check cell (its source
    ends with the line CHECK_MARK, whose token the learner's notebook cannot hold) runs in the
    grader's namespace instead: what the set-up and check cells bound, plus, bound afresh
    from the learner's namespace before each check, only `learner_names` (what the exercise's
    answer cells define). What a check binds is copied to the learner's namespace afterwards,
    so that later answer cells see the notebook they would see in Jupyter.

    Before every cell it puts back what the kernel started with: the builtins module's
    entries, sys.stdout/stderr/displayhook/excepthook, IPython's input and AST transformers,
    display hook and publisher, traceback printers; during a check also IPython's event
    callbacks. It runs from IPython's `transform_cell`, before any transformer sees the cell.
    """
    import builtins
    import inspect as _inspect
    import sys as _sys
    import types

    shell = get_ipython()  # noqa: F821 - run in the kernel
    mark = "\n" + CHECK_MARK.format(token=token)
    user_ns, user_module = shell.user_ns, shell.user_module
    grader = types.ModuleType("__main__")
    grader_ns = grader.__dict__
    grader_ns.update({k: user_ns[k] for k in shell.user_ns_hidden if k in user_ns})
    grader_ns.update(__name__="__main__", __builtins__=builtins, print=builtins.print)  # as the kernel started

    def _fallback(name):  # pickle finds a learner's class through sys.modules["__main__"]
        try:
            return user_ns[name]
        except KeyError:
            raise AttributeError(name) from None
    grader_ns["__getattr__"] = _fallback
    hidden = set(grader_ns)

    pristine = dict(vars(builtins))
    from IPython.core.builtin_trap import BuiltinUndefined
    for key, orig in shell.builtin_trap._orig_builtins.items():  # this runs inside a cell:
        if orig is BuiltinUndefined:                               # not what IPython adds for it
            pristine.pop(key, None)
        else:
            pristine[key] = orig
    mgr = shell.input_transformer_manager
    pinned = [(o, n, getattr(o, n)) for o, names in (
        (_sys, ("stdout", "stderr", "displayhook", "excepthook")),
        (shell, ("input_transformers_post", "input_transformer_manager", "ast_transformers", "displayhook", "display_pub", "display_trap", "showtraceback",
                 "_showtraceback", "showsyntaxerror", "showindentationerror", "transform_ast",
                 "run_ast_nodes", "run_code", "compile", "ast_node_interactivity", "events")),
        (shell.display_trap, ("hook",)),
        (mgr, ("cleanup_transforms", "line_transforms", "token_transformers")),
        (type(_sys.stdout), ("write", "flush", "writelines")),
        (type(shell), ("run_ast_nodes", "run_code", "transform_ast", "showtraceback", "_showtraceback")),
    ) for n in names if hasattr(o, n)]
    lists = [(lst, list(lst)) for lst in (shell.input_transformers_cleanup, shell.input_transformers_post,
                                          shell.ast_transformers, mgr.cleanup_transforms,
                                          mgr.line_transforms, mgr.token_transformers)]
    events = {k: list(v) for k, v in shell.events.callbacks.items()}
    state = {"check": False, "before": {}, "learner_events": None}
    original = shell.transform_cell

    def restore():
        bdict = vars(builtins)
        for key, value in pristine.items():
            if bdict.get(key, restore) is not value:
                bdict[key] = value
        for lst, items in lists:
            lst[:] = items
        for obj, name, value in pinned:
            now = getattr(obj, name, None)
            if now is not value and not (_inspect.ismethod(now) and now == value):
                try:
                    setattr(obj, name, value)
                except (AttributeError, TypeError):  # a read-only property: its list is restored
                    pass

    def leave_check():
        before = state["before"]
        for name, value in list(grader_ns.items()):
            if name not in hidden and name not in learner_names and before.get(name, restore) is not value:
                user_ns[name] = value
        for k, v in state["learner_events"].items():
            shell.events.callbacks.setdefault(k, [])[:] = v
        shell.user_module, shell.user_ns = user_module, user_ns
        _sys.modules["__main__"] = user_module
        state["check"] = False

    def enter_check():
        for name in learner_names:
            if name in user_ns:
                grader_ns[name] = user_ns[name]
            else:
                grader_ns.pop(name, None)
        grader_ns["__builtins__"] = builtins
        state["before"] = dict(grader_ns)
        state["learner_events"] = {k: list(v) for k, v in shell.events.callbacks.items()}
        for k, v in shell.events.callbacks.items():
            v[:] = events.get(k, [])
        shell.user_module, shell.user_ns = grader, grader_ns
        _sys.modules["__main__"] = grader
        state["check"] = True

    def transform_cell(raw_cell):
        restore()
        if state["check"]:
            leave_check()
        if raw_cell.endswith(mark):
            raw_cell = raw_cell[: -len(mark)] + "\n"
            enter_check()
        return original(raw_cell)

    shell.transform_cell = transform_cell
    pinned.append((shell, "transform_cell", transform_cell))


def _guard_source(token: str, names: list[str]) -> str:
    return (f"CHECK_MARK = {CHECK_MARK!r}\n{inspect.getsource(_kernel_guard)}\n"
            f"_kernel_guard({token!r}, {names!r})\ndel _kernel_guard, CHECK_MARK\n")


def pytest_addoption(parser):
    parser.addoption("--minitron-config-fd", type=int, default=None,
                     help="a pipe holding the grader's JSON configuration (python -m minitron.grade)")


def pytest_configure(config):
    fd = config.getoption("--minitron-config-fd")
    if fd is not None:
        with os.fdopen(fd) as f:
            _config.update(json.load(f))


def _notebook(cwd: str | None) -> dict:
    return _config.get("notebooks", {}).get(os.path.realpath(cwd), {}) if cwd else {}


def _kernel_env() -> dict:
    """The kernel's environment: this process's, less what pytest and the grader set."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MINITRON_GRADE"))}


if _nbval is not None and hasattr(_nbval, "RunningKernel"):
    class GuardedKernel(_nbval_kernel.RunningKernel):
        """nbval's kernel, started in the learner's folder with the guard installed, and
        watched: a dead kernel fails the cell at once."""

        def __init__(self, kernel_name, cwd=None, startup_timeout=60):
            notebook = _notebook(cwd)
            self.km, self.kc = _nbval_kernel.start_new_kernel(
                startup_timeout=startup_timeout, kernel_name=kernel_name,
                stderr=open(os.devnull, "w"), cwd=notebook.get("cwd", cwd), env=_kernel_env())
            self._ensure_iopub_up()
            if _config.get("token"):
                code = _guard_source(_config["token"], notebook.get("names", []))
                msg_id = self.kc.execute(code, silent=True, store_history=False)
                reply = self.kc.get_shell_msg(timeout=60)  # the only request in flight
                if reply["parent_header"].get("msg_id") != msg_id or reply["content"]["status"] != "ok":
                    raise RuntimeError(f"the grader's guard did not install: {reply['content']}")

        def await_reply(self, msg_id, timeout=None):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if wait <= 0:
                    raise Empty
                try:
                    return super().await_reply(msg_id, timeout=wait)
                except Empty:
                    if not self.is_alive():
                        process = getattr(getattr(self.km, "provisioner", None), "process", None)
                        code = getattr(process, "returncode", None)
                        raise KernelDied("the Python process running the notebook ended"
                                         + (f" (exit status {code})" if code is not None else "")) from None

    _nbval.RunningKernel = GuardedKernel


def pytest_collection_modifyitems(items):
    token = _config.get("token")
    for item in items:
        cell = getattr(item, "cell", None)
        if token and cell is not None and not cell.get("metadata", {}).get("minitron_answer"):
            cell.source = cell.source.rstrip("\n") + "\n" + CHECK_MARK.format(token=token)


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
        error = call.excinfo.value if call.excinfo else None
        message = _ANSI.sub("", str(error)) if error is not None else ""
        record["message"] = message.splitlines()[0] if message else ""
        if isinstance(error, KernelDied) or "Kernel dead on test start" in message:
            record["died"] = True
        outputs = getattr(item, "test_outputs", None) or []
        errors = [o for o in outputs if o.get("output_type") == "error"]
        if errors:
            record.update(ename=errors[-1].get("ename", ""), evalue=errors[-1].get("evalue", ""),
                          traceback=[_ANSI.sub("", t) for t in errors[-1].get("traceback", [])])
        else:
            record.update(expected=output_text(item.cell.get("outputs")), got=output_text(outputs))
    _records.setdefault(str(item.parent.path), {})[item.cell_num] = record


def sign(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def pytest_sessionfinish(session):
    path = _config.get("record")
    if path:
        body = json.dumps(_records, indent=1)
        with open(path, "w") as f:
            f.write(sign(bytes.fromhex(_config["key"]), body) + "\n" + body)
