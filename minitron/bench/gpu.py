"""The GPU check: everything that needs a GPU, in one command, within 8 minutes on one H200.

    python -m minitron.bench gpu            # make gpu-check
    python -m minitron.bench gpu --dry-run  # what it would run, on any machine; runs nothing

Its parts run one after another, each in its own process (a fresh CUDA context; the parent never
touches CUDA, so a forked NCCL rank of a part can still start) and under its own share of the
budget, cut short when the budget is spent:

  kernels    every fused kernel against torch eager and torch.compile, the copy bandwidth and
             the bf16 matmul rate measured in the same run as ceilings (bench kernels --quick);
             its first row is flash attention at s=4096, d=128, causal, bf16, forward and
             backward, whose pct_of_ceiling is its fraction of the measured matmul rate
  train      one training step of a 350M GPT in bf16 on one GPU through the engine: eager,
             --kernels and compiled blocks; step time, tokens/s, MFU, and the planner's
             predicted step beside them (gpu_train.py)
  verify     python -m minitron.verify on one CUDA rank (NCCL, world size 1), with and without
             the kernels
  tests      the GPU-only tests (pytest -m gpu: those skipped on a CPU for needing a GPU)

CSVs go to bench/results/, named by GPU and date: kernels_<gpu>_<date>.csv,
train_step_<gpu>_<date>.csv and gpu_check_<gpu>_<date>.csv (every part: its command, status,
seconds and headline). The last thing printed is that table.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import os
import subprocess
import sys
import time

BUDGET_S = 480
RESULTS = os.path.join("bench", "results")
NCCL = {"MINITRON_BACKEND": "nccl"}   # a CUDA rank for sure, whatever the caller's environment says
GPU_TESTS = ["tests/test_gpu.py", "tests/test_kernels.py", "tests/test_model_kernels.py",
             "tests/test_bench.py", "tests/test_context_parallel.py",
             "tests/test_fp8.py"]   # torch._scaled_mm against the emulation (skipped without FP8 cores)


@dataclasses.dataclass
class Part:
    name: str
    what: str
    argv: list[str]          # after `python`
    seconds: int             # its share of the budget
    csv: str | None = None   # the CSV it writes itself
    env: dict = dataclasses.field(default_factory=dict)   # set for it, on top of ours

    def command(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), "python", *self.argv])


def tag(text: str) -> str:
    """A GPU's name as a file name: 'NVIDIA H200' -> 'NVIDIA-H200'."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-") or "unknown"


def plan(gpu: str, date: str) -> list[Part]:
    """The parts, in order; their shares add up to less than BUDGET_S (the GPU probe and
    process start-ups take the rest)."""
    kernels_csv = os.path.join(RESULTS, f"kernels_{tag(gpu)}_{date}.csv")
    train_csv = os.path.join(RESULTS, f"train_step_{tag(gpu)}_{date}.csv")
    verify = ["-m", "minitron.verify", "--tp", "1", "--steps", "2"]
    return [
        Part("kernels", "fused kernels vs eager and torch.compile; copy and bf16 matmul ceilings; "
             "flash attention s=4096 d=128 causal bf16 fwd+bwd as a fraction of the matmul rate",
             ["-m", "minitron.bench", "kernels", "--quick", "--budget-s", "100", "--csv", kernels_csv],
             130, kernels_csv),
        Part("train", "a 350M GPT, bf16, one GPU, through TrainingRun: eager, --kernels, compiled "
             "blocks; step time, tokens/s, MFU, beside the planner's prediction",
             ["-m", "minitron.bench", "gpu", "--part", "train", "--csv", train_csv], 140, train_csv),
        Part("verify", "minitron.verify on one CUDA rank (NCCL, world size 1)", verify, 40,
             env=NCCL),
        Part("verify --kernels", "the same with the fused kernels", verify + ["--kernels"], 50,
             env=NCCL),
        Part("tests", "the GPU-only tests (skipped on a CPU)",
             ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TESTS], 100),
    ]


def gpu_name() -> str | None:
    """The first GPU's name, asked in a child process (this one never initialises CUDA)."""
    import torch
    if torch.cuda.device_count() == 0:       # NVML: no CUDA context made
        return None
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                           capture_output=True, text=True, timeout=60)
    return probe.stdout.strip() or None


def dry_run(gpu: str | None, date: str) -> int:
    parts = plan(gpu or "GPU", date)
    where = gpu or "no GPU on this machine: the files are named after the GPU that runs it"
    print(f"python -m minitron.bench gpu would run, within {BUDGET_S} s ({where}):")
    for i, part in enumerate(parts, 1):
        print(f"  {i}. {part.name} (at most {part.seconds} s): {part.what}")
        print(f"       {part.command()}")
    print(f"  total of the parts' shares: {sum(p.seconds for p in parts)} s")
    print("it would write:")
    for path in [p.csv for p in parts if p.csv] + [summary_path(gpu or "GPU", date)]:
        print(f"  {path}")
    return 0


def summary_path(gpu: str, date: str) -> str:
    return os.path.join(RESULTS, f"gpu_check_{tag(gpu)}_{date}.csv")


def run_part(part: Part, seconds: float) -> dict:
    """Run one part (its output passes through), within `seconds`; what happened, as a row."""
    t0 = time.time()
    print(f"\n=== {part.name}: {part.command()}", flush=True)
    try:
        proc = subprocess.run([sys.executable, *part.argv], capture_output=True, text=True,
                              timeout=max(1.0, seconds), env={**os.environ, **part.env})
        out, status = proc.stdout + proc.stderr, "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timed out after {seconds:.0f} s"
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    return {"part": part.name, "command": part.command(), "status": status,
            "seconds": round(time.time() - t0), "headline": headline(part, out)}


def headline(part: Part, out: str) -> str:
    """The part's result in one line: read from its CSV, or the verdict line it printed."""
    from .gpu_report import kernels_headline, train_headline, verdict_line
    if part.name == "kernels":
        return kernels_headline(part.csv)
    if part.name == "train":
        return train_headline(part.csv)
    return verdict_line(out)


def run_check(budget_s: float, date: str) -> int:
    from .gpu_report import table
    gpu = gpu_name()
    if gpu is None:
        print("minitron.bench gpu: needs a CUDA GPU, and this machine has none; "
              "--dry-run shows what it would run", file=sys.stderr)
        return 1
    os.makedirs(RESULTS, exist_ok=True)
    start, rows = time.time(), []
    for part in plan(gpu, date):
        left = budget_s - (time.time() - start)
        if left < 10:
            rows.append({"part": part.name, "command": part.command(),
                         "status": "not run: budget spent", "seconds": 0, "headline": ""})
            continue
        rows.append(run_part(part, min(part.seconds, left)))
    with open(summary_path(gpu, date), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{gpu}, {date}, {time.time() - start:.0f} s of {budget_s:.0f}; "
          f"wrote {summary_path(gpu, date)}\n{table(rows)}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def train_part(csv_path: str | None, smoke: bool, variants) -> int:
    from .gpu_report import write_csv
    from .gpu_train import FIELDS, run
    rows = run(variants, smoke=smoke)
    for r in rows:
        print(f"{r['variant']:>8}: " + (r["error"] or f"{r['step_s']} s/step, {r['tokens_per_s']} "
              f"tokens/s, MFU {r['mfu'] or 'n/a'}, {r['peak_memory_gb']} GiB"))
    if csv_path:
        write_csv(csv_path, FIELDS, rows)
        print(f"wrote {csv_path}")
    return 0 if all(not r["error"] for r in rows) else 1


def parser() -> argparse.ArgumentParser:
    from .gpu_train import VARIANTS
    p = argparse.ArgumentParser(prog="python -m minitron.bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print what it would run; run nothing")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="for all the parts together")
    p.add_argument("--part", choices=("train",), default=None, help="run one part here (the check "
                   "runs each so, in its own process)")
    p.add_argument("--csv", default=None, help="with --part: where its rows go")
    p.add_argument("--smoke", action="store_true", help="with --part train: a tiny model, any device")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="with --part train")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    date = datetime.date.today().isoformat()
    if args.part == "train":
        return train_part(args.csv, args.smoke, args.variants)
    if args.dry_run:
        return dry_run(gpu_name(), date)
    return run_check(args.budget_s, date)
