"""The GPU check's summary: each part's result in one line, read from the CSV it wrote or the
verdict it printed, and the table printed at the end (gpu.py runs the parts)."""
from __future__ import annotations

import csv
import os
import re

ATTENTION_SHAPE = "s4096"     # the flash-attention row the check quotes: s=4096, d=128, causal


def write_csv(path: str, fields: list[str], rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _read(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def attention_fraction(rows: list[dict]) -> tuple[float, float, float] | None:
    """Flash attention at s=4096 as fractions of the measured matmul rate: forward, backward,
    and forward + backward together (their FLOPs over their summed time), or None."""
    found = {r["direction"]: r for r in rows
             if r["kernel"] == "flash_attention" and ATTENTION_SHAPE in r["shape"] and "d128" in r["shape"]}
    if not {"fwd", "bwd"} <= set(found):
        return None
    f, b = found["fwd"], found["bwd"]
    flops = {d: float(r["achieved"]) * float(r["ms_triton"]) for d, r in found.items()}  # TFLOP/s x ms
    both = (flops["fwd"] + flops["bwd"]) / (float(f["ms_triton"]) + float(b["ms_triton"]))
    ceiling = float(f["ceiling"])
    return float(f["pct_of_ceiling"]) / 100, float(b["pct_of_ceiling"]) / 100, both / ceiling


def kernels_headline(path: str | None) -> str:
    rows = _read(path)
    if not rows:
        return "no rows"
    ceilings = {r["unit"]: r["ceiling"] for r in rows}
    text = (f"{len(rows)} rows; ceilings {ceilings.get('GB/s', '?')} GB/s copy, "
            f"{ceilings.get('TFLOP/s', '?')} TFLOP/s bf16 matmul")
    fractions = attention_fraction(rows)
    if fractions:
        text += ("; flash attention s4096 d128 causal: fwd {:.0%}, bwd {:.0%}, fwd+bwd {:.0%} of "
                 "the matmul rate").format(*fractions)
    slower = [f"{r['kernel']} {r['direction']}" for r in rows if r["vs_eager"] and float(r["vs_eager"]) < 1]
    return text + (f"; slower than eager: {', '.join(slower)}" if slower else "")


def train_headline(path: str | None) -> str:
    rows = _read(path)
    if not rows:
        return "no rows"
    parts = []
    for r in rows:
        if r["error"]:
            parts.append(f"{r['variant']} failed ({r['error'][:80]})")
        else:
            mfu = f"MFU {float(r['mfu']):.0%}" if r["mfu"] else "MFU n/a"
            parts.append(f"{r['variant']} {float(r['step_s']) * 1e3:.0f} ms, "
                         f"{int(r['tokens_per_s']):,} tok/s, {mfu}")
    return f"{int(rows[0]['params'] or 0) / 1e6:.0f}M params: " + "; ".join(parts)


def verdict_line(out: str) -> str:
    """verify's PASS/FAIL line, pytest's count line, else the last line printed."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("PASS", "FAIL")) or re.search(r"\d+ (passed|failed|skipped|deselected)", ln):
            return ln.strip("= ")
    return lines[-1][:200] if lines else ""


def table(rows: list[dict]) -> str:
    """Part | status | seconds | result, fixed width, one line per part."""
    widths = [max(len("part"), *(len(r["part"]) for r in rows)),
              max(len("status"), *(len(r["status"]) for r in rows)), 7]
    head = f"{'part':<{widths[0]}} | {'status':<{widths[1]}} | {'seconds':>7} | result"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['part']:<{widths[0]}} | {r['status']:<{widths[1]}} | {r['seconds']:>7} | "
                     f"{r['headline']}")
    return "\n".join(lines)
