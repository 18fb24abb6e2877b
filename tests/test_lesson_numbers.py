"""Every number a lesson's prose states comes from a run of that lesson or from a cited constant.

The markdown of every lesson is read for claims: each number with three or more significant
digits, each percentage and each ratio ("0.79x", "6x faster"). A claim is backed when one of the
notebook's stored outputs prints a number that rounds to it at the claim's precision (a percentage
also matches the fraction, 19% <- 0.19; a plain number may be printed or cited in another unit,
268M <- 268,435,456, 989 TFLOP/s <- 989e12), or when it is one of minitron.sources.constants(). Not claims: code (`...`, fenced), link targets, issue numbers (#2565), years (1900-2030), arXiv
numbers, and integers that are powers of two (shapes and sizes the cells set, not results).
A sentence about a measured run must be printed by the cell that compares it, so its numbers are
in that cell's output; a number typed in prose that no run prints fails here, naming the cell.
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from minitron.sources import constants

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))

NUMBER = re.compile(r"(?<![\w.,/#])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?![\w.]*\d)"
                    r"(?:\s?\\?(%)|(×|x)(?![\w\d])|\s?(×|x)(?!\s*[\d$\\(]))?")
YEAR = range(1900, 2031)


def prose(cell: dict) -> str:
    """A markdown cell's text without code, link targets, HTML tags and arXiv numbers."""
    text = "".join(cell["source"])
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "] ", text)
    text = re.sub(r"<[^>]*>", " ", text)
    return re.sub(r"\d{4}\.\d{4,5}", " ", text)


def significant_digits(token: str) -> int:
    digits = token.replace(",", "")
    if "." in digits:
        return len(digits.replace(".", "").lstrip("0"))
    return len(digits.lstrip("0").rstrip("0"))


def claims(text: str) -> list[tuple[str, float, int, str]]:
    """(as written, value, decimals, kind) of each claim in `text`; kind: number, percent, ratio."""
    out = []
    for m in NUMBER.finditer(text):
        token, percent, ratio = m.group(1), m.group(2), m.group(3) or m.group(4)
        value = float(token.replace(",", ""))
        decimals = len(token.split(".")[1]) if "." in token else 0
        kind = "percent" if percent else "ratio" if ratio else "number"
        if kind == "number":
            if significant_digits(token) < 3 or "." not in token and (
                    int(value) in YEAR or (value >= 1 and int(value) & (int(value) - 1) == 0)):
                continue
        out.append((m.group(0).strip(), value, decimals, kind))
    return out


def printed(nb: dict) -> list[float]:
    """Every number in the notebook's stored outputs (text and plain-text data)."""
    values = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            for token in re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[+-]?\d+)?", text):
                values.append(float(token.replace(",", "")))
    return values


def _rounds_to(value: float, claim: float, decimals: int) -> bool:
    return abs(value - claim) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def backed(claim: tuple[str, float, int, str], outputs: list[float], cited: list[float]) -> bool:
    _, value, decimals, kind = claim
    scales = [0.01, 1.0] if kind == "percent" else [1.0]            # 19% <- 0.19
    if any(_rounds_to(v / s, value, decimals) for v in outputs for s in scales):
        return True
    units = [1.0] if kind != "number" else [10.0 ** (3 * k) for k in range(-5, 6)]   # 989 TFLOP/s <- 989e12
    return any(_rounds_to(v / s / u, value, decimals) for v in outputs + cited for s in scales for u in units)


def unbacked(nb: dict) -> list[str]:
    outputs, cited = printed(nb), [c.value for c in constants().values()]
    return [f"cell [{i}]: {c[0]!r}" for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "markdown"
            for c in claims(prose(cell)) if not backed(c, outputs, cited)]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_number_in_the_prose_is_printed_or_cited(path):
    missing = unbacked(json.loads(path.read_text()))
    assert not missing, (f"{path.name}: numbers in markdown that no stored output prints and no "
                         f"constant in minitron/sources.py cites: " + "; ".join(missing))


def test_the_reader_finds_what_a_lesson_claims():
    text = ("The bubble took 37.5% of the step, 0.79× of the plain run and 12.6 ms of 4096 tokens, "
            "in 2019 (arXiv 2104.04473), 8 × 8 GPUs, `tp=12345`, h = 12288.")
    assert [c[0] for c in claims(prose(dict(source=[text])))] == ["37.5%", "0.79×", "12.6", "12288"]


def test_a_planted_wrong_number_fails():
    """A test of the test: lesson 04's stored outputs back its prose until a number is changed."""
    nb = json.loads(next(p for p in LESSONS if p.name.startswith("04_")).read_text())
    assert unbacked(nb) == []
    i = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown" and "18.8%" in prose(c))
    nb["cells"][i]["source"] = [line.replace("18.8%", "18.3%") for line in nb["cells"][i]["source"]]
    assert unbacked(nb) == [f"cell [{i}]: '18.3%'"]
    value = next(v for v in printed(nb) if v > 10 and v != int(v))
    right = dict(cell_type="markdown", source=[f"The run printed {value:.1f}."])
    wrong = dict(cell_type="markdown", source=[f"The run printed {value * 1.37:.1f}."])
    nb["cells"][i]["source"] = [line.replace("18.3%", "18.8%") for line in nb["cells"][i]["source"]]
    assert unbacked({"cells": nb["cells"] + [right]}) == []
    assert unbacked({"cells": nb["cells"] + [wrong]}) == [f"cell [{len(nb['cells'])}]: '{value * 1.37:.1f}'"]


def test_every_cited_constant_names_its_source():
    for name, c in constants().items():
        assert c.source.strip() and c.value == c.value, name
