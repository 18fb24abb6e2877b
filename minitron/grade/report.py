"""Name a graded notebook's cells and failures in words a learner can act on (minitron.grade).

Each failing code cell gets a name in words (the markdown heading above it, e.g. "Check 2:
against `FlatLayout` on a GPT and by hand", see cell_names) and a reason: which exception,
raised in which function, unwrapped from a rank's traceback or a Triton interpreter error; the
first output line that differs from the reference; or that the kernel's process ended.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import NamedTuple

STUB_MESSAGE = "your code here"
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_NEW_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_FRAME = re.compile(  # a frame's header, as Python, IPython (a cell) and IPython (a file) print it
    r'^\s*(?:File "[^"]*", line (\d+)|Cell In\[\d+\], line (\d+)|File \S+:(\d+)), in ([\w<>.]+)', re.M)
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*): ?(.*)$")
_WRAPPED = re.compile(r"""^([A-Za-z_]\w*)\((['"])(.*)\2\)$""", re.S)  # e.g. NotImplementedError('...')


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    """A traceback line without its colours."""
    return _ANSI.sub("", text)


def output_text(outputs) -> str:
    """What a learner reads in a cell's output area: streams and plain-text results."""
    parts = []
    for out in outputs or []:
        kind = out.get("output_type")
        if kind == "stream":
            text = out.get("text", "")
            parts.append("".join(text) if isinstance(text, list) else text)
        elif kind in ("execute_result", "display_data"):
            text = out.get("data", {}).get("text/plain", "")
            parts.append(("".join(text) if isinstance(text, list) else text) + "\n")
        elif kind == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}\n")
    return "".join(parts)


ANSWER_MARK = "# BEGIN SOLUTION"   # tools/make_exercises.py cuts the learner's part at it


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


def is_answer_cell(cell: dict) -> bool:
    """A reference's answer cell: a code cell holding the marker line."""
    return cell.get("cell_type") == "code" and any(
        line.strip() == ANSWER_MARK for line in source(cell).splitlines())


def _is_answer(cell: dict) -> bool:
    """An answer cell of a reference, or of a graded copy (whose source is the learner's)."""
    return cell.get("metadata", {}).get("minitron_answer", False) or is_answer_cell(cell)


_MATH = re.compile(r"\$+([^$]*)\$+")


def _clause(text: str, width: int = 70) -> str:
    """The first clause of a paragraph, as plain words: what a cell below it does."""
    text = _MATH.sub(lambda m: m.group(1).replace("\\", ""), text)
    text = " ".join(text.replace("`", "").replace("**", "").replace("*", "").split())
    text = re.split(r"[:;(]|\.(?:\s|$)", text, maxsplit=1)[0].strip(" ,")
    if len(text) > width:
        cut = text.rfind(",", 0, width)
        text = text[:cut] if cut > 20 else text[: width - 3] + "..."
    return text


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text)
            if p.strip() and not all(_HEADING.match(line) for line in p.strip().splitlines())]


def cell_names(nb: dict) -> list[str]:
    """A name in words for each code cell, in order (nbval's "Cell N" is the N-th code cell).

    A check is named by the heading above it ("Check 2: against FlatLayout..."); a bare
    "Check 1" gets the first clause of the text below it; a cell whose text above has no
    heading, by that text's last sentence ("the cell under 'At Megatron's scale'")."""
    names, heading, part, above = [], "", "the notebook's start", None
    for cell in nb["cells"]:
        text = source(cell)
        if cell["cell_type"] == "markdown":
            found = [m.group(1) for m in map(_HEADING.match, text.splitlines()) if m]
            if found:
                heading = part = found[-1]
                above = ("heading", heading, _paragraphs(text))
            else:
                above = ("text", heading, _paragraphs(text))
            continue
        if cell["cell_type"] != "code":
            continue
        kind, under, paragraphs = above or ("code", heading, [])
        above = None
        if _is_answer(cell):
            names.append(f"your answer cell under '{part}'")
        elif kind == "heading" and "check" in under.lower():
            bare = re.fullmatch(r"check\s+\w+", under.strip(), re.I) and paragraphs
            names.append(f"{under}: {_clause(paragraphs[0])}" if bare else under)
        elif kind == "text" and paragraphs:
            last = re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(paragraphs[-1].split()))[-1]
            names.append(f"the cell under '{_clause(last)}'")
        else:
            names.append(f"the cell under '{heading or part}'")
    return names


def _definitions(text: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, last line) of each function and class defined in a cell."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append((prefix + child.name, child.lineno, child.end_lineno))
                walk(child, prefix + child.name + ".")
    walk(tree, "")
    return found


def learner_function(nb: dict, function: str, line: int) -> str:
    """The learner's function that `function` (raising at `line`) is, qualified: e.g.
    'Gather.forward' when two classes of the answer cells define a forward; '' if none is."""
    short = function.rsplit(".", 1)[-1]
    named = [d for c in nb["cells"] if c["cell_type"] == "code" and _is_answer(c)
             for d in _definitions(source(c)) if d[0].rsplit(".", 1)[-1] == short]
    at_line = [name for name, first, last in named if first <= line <= last]
    names = sorted(set(at_line or [name for name, _, _ in named]))
    return " or ".join(names)


class Raised(NamedTuple):
    exception: str   # e.g. "NotImplementedError"
    message: str
    function: str    # the function it was raised in ("" if unknown)
    line: int        # and the line, counted in that function's cell or file


def root_exception(ename: str, evalue: str, traceback: list[str]) -> Raised:
    """The exception that really went wrong, and where it was raised.

    A rank's exception arrives as a RankError holding the rank's traceback; a Triton kernel's
    as an InterpreterError raised `from` it: follow both to the original exception.
    """
    text = "\n".join(traceback) if traceback else f"{ename}: {evalue}"
    starts = [m.start() for m in _NEW_TRACEBACK.finditer(text)]
    blocks = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    i = len(blocks) - 1
    while i > 0 and "direct cause of the following exception" in blocks[i - 1]:
        i -= 1
    name, message, where, line = ename, evalue, "", 0
    if blocks:
        block = blocks[i]
        frames = list(_FRAME.finditer(block))
        if frames:
            where, line = frames[-1].group(4), int(next(filter(None, frames[-1].groups()[:3])))
        after = block[frames[-1].end():] if frames else block
        for text_line in after.splitlines()[1:] if frames else after.splitlines():
            m = _EXCEPTION_LINE.match(text_line)
            if m and not text_line.startswith((" ", "\t")):
                name, message = m.group(1).rsplit(".", 1)[-1], m.group(2)
                break
    wrapped = _WRAPPED.match(message.strip())
    if wrapped and wrapped.group(1).endswith(("Error", "Exception")):  # InterpreterError("X('...')")
        name, message = wrapped.group(1), wrapped.group(3)
    return Raised(name, message, where, line)


def first_difference(expected: str, got: str) -> tuple[int, str, str]:
    """(line number from 1, reference line, learner's line) of the first line that differs."""
    want, have = expected.splitlines(), got.splitlines()
    for k in range(max(len(want), len(have))):
        a = want[k] if k < len(want) else "<nothing>"
        b = have[k] if k < len(have) else "<nothing>"
        if a != b:
            return k + 1, a, b
    return 0, "", ""


def _short(line: str, width: int = 90) -> str:
    line = " ".join(line.split())
    return line if len(line) <= width else line[: width - 3] + "..."


@dataclass
class Failure:
    cell: int            # the code cell's number (nbval's "Cell N")
    where: str           # the cell in words
    kind: str            # "exception", "value" (a shown value differs), "output" (a printed
                         # text differs: a check not yet converted to show) or "other"
    exception: str = ""  # the root exception's name, e.g. NotImplementedError
    message: str = ""
    raised_in: str = ""  # the function it was raised in
    yours: bool = False  # raised_in is one of the learner's functions
    expected: str = ""   # first differing output line: the reference's
    got: str = ""        # and the learner's
    line: int = 0
    died: bool = False   # the kernel's process ended during this cell

    @property
    def stub(self) -> bool:
        return self.exception == "NotImplementedError" and self.message == STUB_MESSAGE

    @property
    def reason(self) -> str:
        if self.kind == "exception":
            if self.stub:
                who = f"your {self.raised_in}" if self.yours else "your code"
                return f"{who} is not written yet (its stub raised NotImplementedError)"
            who = f"your {self.raised_in} raised" if self.yours else "it raised"
            return f"{who} {self.exception}: {_short(self.message, 120)}"
        if self.kind == "value":
            return self.message
        if self.kind == "output" and self.line:
            return f"its output differs from the reference at line {self.line}: '{_short(self.got)}'"
        if self.kind == "output":
            return "its output differs from the reference (not in its text: a figure or a data type)"
        return self.message

    def details(self) -> list[str]:
        if self.kind == "output":
            return [f"{self.where}, output line {self.line}:",
                    f"    yours:     {self.got}", f"    reference: {self.expected}"]
        if self.kind == "exception":
            place = f" in {self.raised_in}" if self.raised_in else ""
            return [f"{self.where} raised {self.exception}{place}: {self.message}"]
        return [f"{self.where}: {self.message}"]
