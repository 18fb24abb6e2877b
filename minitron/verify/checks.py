"""The comparisons behind minitron.verify: tolerances, rows, the update check, replica checks.

Tolerances for logits, loss, dL/dX and gradients (see `float32_tolerance`): both sides compute
the same sums in float32, in different orders (a split reduction, a different kernel), so each
result differs from the exact one by rounding. For a sum of K terms the rounding error grows
like sqrt(K) * eps32 relative to the terms (a random walk of K roundings, eps32 = 2^-23); the
longest sum in the model, K = max(hidden, ffn, vocab, seq, batch*seq), sets the bar, and a
constant C covers the chain of such sums (layers, forward then backward) and the errors of
both sides:

    tol = C * sqrt(K) * eps32,   C = 4            (default model: K = 256, tol = 7.6e-6)

C is measured, not guessed (tests/test_verify.py). In units of sqrt(K) * eps32, the float32
reference's own error against a float64 reference of the same weights is at most 0.45 on
the shapes tried, and so does a correct split's error against the float32 reference (tp 1 to
8, SP, GQA, RMSNorm/SwiGLU/RoPE, dropout, the fused kernels): a split is as accurate as one
device. C = 4 leaves a margin of about 9 over that (tests/test_verify.py asserts at least 4),
while a 1% error anywhere is 1000 times over. The loss is computed in float32 on both sides whatever the dtype, so float64 runs are
held to the same bar.

The optimizer step is checked at its own scale. Adam moves a weight by about lr * sign(g)
however small |g| is, so an entry of g that is rounding noise (the key bias's gradient is
zero in exact arithmetic) would turn two slightly different gradients into two full, opposite
steps. So both optimizers are driven by the same gradients, the reference's (each rank gets
its shards of them); the gradients themselves are compared separately, above. Then the update
u = w_new - w_old of every tensor is compared with the reference's update, relative to the
largest entry of that update, after allowing each entry the float32 spacing of the stored
weight (2 ulp: w_new is rounded once on each side; an update is only as precise as the weight
that holds it). AdamW is elementwise, so what remains is a few roundings of the step itself:

    update tol = 16 * eps32 = 1.9e-6     (measured: 0 with torch's eager AdamW, <= 0.3 eps32 with its
                                          fused CPU kernel, ZeroOptimizer's on CPU; <= 1.1 eps32 with
                                          the Triton kernel)

A 1% error in one tensor's update is then 5000 times over (a norm weight of 1.0 moved by
lr = 1e-4 is resolved only to 2.4e-7 of its 1e-4 update: still caught, at 7.6e-3).

Replicas: a parameter that a group holds whole (norm weights, row-parallel biases and learned
positions on the tensor-parallel group; later every parameter on the data- and context-
parallel groups, and the tied embedding on the pipeline's embedding group) must stay bitwise
identical across that group, gradients and weights alike, or the ranks train different
models. `replica_rows` all-gathers them (counted, through minitron.runtime.comm) and compares bytes.
"""
from __future__ import annotations

import dataclasses
import math
import re

import torch

from ..runtime import comm
from ..grid import Grid
from ..config import ModelConfig
from ..model.convert import Rule, rules
from .compare import rel_err

EPS32 = torch.finfo(torch.float32).eps
C_SUM = 4          # tol = C_SUM * sqrt(K) * eps32 for logits, loss, dL/dX, gradients
C_UPDATE = 16      # update tol = C_UPDATE * eps32, beyond the weight's own spacing
ULP_SLACK = 2      # spacings of the stored weight allowed per entry of an update
FLOOR = 1e-3       # a tensor with no scale of its own is measured against this much of the largest


@dataclasses.dataclass
class Row:
    step: int
    quantity: str
    err: float
    tol: float
    detail: str = ""      # what went wrong, where a number alone does not say (replicas)

    @property
    def ok(self) -> bool:
        return self.err <= self.tol   # False for NaN too


@dataclasses.dataclass
class Report:
    rows: list[Row]

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def max_rel_err(self) -> float:
        return max(r.err for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def worst(self, rows: list[Row]) -> Row:
        """The row nearest to (or furthest past) its tolerance."""
        return max(rows, key=_ratio)

    def table(self) -> str:
        width = max(len(r.quantity) for r in self.rows)
        lines = [f"{'step':>4}  {'quantity':<{width}}  {'rel_err':>9}  {'tol':>8}  {'margin':>7}  ok"]
        for r in self.rows:
            tol = f"{r.tol:8.1e}" if r.tol else f"{'bitwise':>8}"
            margin = f"{r.tol / r.err:6.0f}x" if r.tol and r.err > 0 else f"{'-':>7}"
            lines.append(f"{r.step:>4}  {r.quantity:<{width}}  {r.err:9.2e}  {tol}  {margin}  "
                         f"{'yes' if r.ok else 'NO'}")
        if self.passed:
            w = self.worst([r for r in self.rows if r.tol] or self.rows)
            lines.append(f"smallest margin: tol/err = {w.tol / w.err if w.err else float('inf'):.0f}x "
                         f"(step {w.step} {w.quantity}: {w.err:.2e} vs tol {w.tol:.1e})")
        return "\n".join(lines)

    def verdict(self) -> str:
        if self.passed:
            return f"PASS max_rel_err={self.max_rel_err:.2e}"
        w = self.worst(self.failures)
        where = w.detail or f"rel_err={w.err:.2e} > tol={w.tol:.1e}"
        return (f"FAIL {len(self.failures)} of {len(self.rows)} comparisons; worst: step "
                f"{w.step} {w.quantity}: {where}")


def _ratio(r: Row) -> float:
    """err / tol; inf for NaN and for any difference where none is allowed."""
    if r.err != r.err:
        return float("inf")
    if r.tol == 0:
        return float("inf") if r.err > 0 else 0.0
    return r.err / r.tol


def longest_sum(cfg: ModelConfig, batch: int, seq: int) -> int:
    """K: the most terms any one number of the step is a sum of."""
    return max(cfg.hidden, cfg.ffn, cfg.vocab_size, seq, batch * seq)


def float32_tolerance(cfg: ModelConfig, batch: int, seq: int) -> float:
    return C_SUM * math.sqrt(longest_sum(cfg, batch, seq)) * EPS32


def update_tolerance() -> float:
    return C_UPDATE * EPS32


def pattern(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def _worst_per_pattern(step: int, kind: str, errs: dict[str, float], tol: float) -> list[Row]:
    worst: dict[str, float] = {}
    for name, e in errs.items():
        prev = worst.get(pattern(name), 0.0)
        worst[pattern(name)] = prev if prev != prev or e <= prev else e   # NaN sticks
    return [Row(step, f"{kind} {p}", e, tol) for p, e in worst.items()]


def _same_names(kind: str, actual: dict, expected: dict) -> None:
    if actual.keys() != expected.keys():
        raise AssertionError(f"{kind}: parameter names differ: {sorted(actual.keys() ^ expected.keys())}")


def grad_rows(step: int, actual: dict, expected: dict, tol: float) -> list[Row]:
    """One row per name pattern: the worst error over the layers it covers.

    Each tensor's error is relative to its own largest entry, but never to less than FLOOR
    times the largest gradient entry in the whole model: a gradient that is zero up to
    rounding (the key bias's: softmax ignores a constant added to all scores of a query) has
    no scale of its own to be relative to.
    """
    _same_names("grad", actual, expected)
    floor = FLOOR * max(e.abs().max().item() for e in expected.values())
    errs = {}
    for name, e in expected.items():
        _same_shape(name, actual[name], e)   # a broadcast would compare the wrong entries
        diff = (actual[name].double() - e.double()).abs().max().item()
        errs[name] = diff / max(e.abs().max().item(), floor)
    return _worst_per_pattern(step, "grad", errs, tol)


def _same_shape(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.shape != expected.shape:
        raise ValueError(f"{name}: the parallel side's shape {tuple(actual.shape)} is not the "
                         f"reference's {tuple(expected.shape)} (a gather or shard rule is wrong)")


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at each |entry| (as float64)."""
    a = t.detach().abs()
    return (torch.nextafter(a, torch.full_like(a, math.inf)) - a).double()


def update_err(new: torch.Tensor, old: torch.Tensor, ref_new: torch.Tensor, ref_old: torch.Tensor) -> float:
    """max |u - u_ref| beyond ULP_SLACK spacings of the weight, over max |u_ref|."""
    _same_shape("weight", new, ref_new)
    u = new.double() - old.double()          # exact: float32 differences fit in float64
    u_ref = ref_new.double() - ref_old.double()
    spacing = ulp(ref_new)
    if new.dtype != ref_new.dtype:
        # fp8: bf16 weights here, float32 in the reference, so both the old and the new weight
        # were rounded on this side only: allow the spacing of either, in this side's dtype
        spacing = torch.maximum(ulp(ref_new.to(new.dtype)), ulp(ref_old.to(new.dtype)))
    excess = ((u - u_ref).abs() - ULP_SLACK * spacing).clamp(min=0).max().item()
    scale = u_ref.abs().max().item()
    return excess / scale if scale > 0 else excess


def update_rows(step: int, new: dict, old: dict, ref_new: dict, ref_old: dict,
                kind: str = "weight") -> list[Row]:
    """kind "weight": the model's weights; "master": a 16-bit run's fp32 master weights."""
    _same_names(kind, new, ref_new)
    errs = {n: update_err(new[n], old[n], ref_new[n], ref_old[n]) for n in ref_new}
    return _worst_per_pattern(step, kind, errs, update_tolerance())


# ---- low precision: errors against the noise of the same precision ----------------------------
C_NORM = 4       # norm-wise error at most C_NORM x the twins' (measured: see noise_rows)
C_ALONG = 12     # the component along the reference at most C_ALONG x the twins' spread of it
NOISY = 0.25     # a reference whose twins differ from it by this much (norm-wise) is mostly
                 # rounding noise itself (the key bias's gradient): no direction to be along


@dataclasses.dataclass
class NoiseStats:
    """One tensor's error e = actual - reference and the twins' n_k = twin_k - reference
    (verify/noise.py), against r = the reference:

        norm       ||e|| / ||r||            floor   RMS over k of ||n_k|| / ||r||
        along      <e, r> / <r, r>          noise   RMS over k of <n_k, r> / <r, r>

    `along` is the error's component along the reference: a scale error (a gradient 1% off:
    along = 0.01) is all along it, rounding noise mostly across (measured in the twins)."""
    norm: float
    floor: float
    along: float
    along_noise: float
    numel: int


def noise_stats(actual: torch.Tensor, expected: torch.Tensor, twins) -> NoiseStats:
    _same_shape("tensor", actual, expected)
    a, r = (x.detach().double().reshape(-1) for x in (actual, expected))
    ns = [t.detach().double().reshape(-1) - r for t in twins]
    e, rr = a - r, float(r @ r)
    rms = lambda xs: (sum(x * x for x in xs) / len(xs)) ** 0.5
    if rr == 0.0:
        return NoiseStats(float(e.norm()), rms([float(n.norm()) for n in ns]), 0.0, 0.0, r.numel())
    norm_r = rr ** 0.5
    return NoiseStats(float(e.norm()) / norm_r, rms([float(n.norm()) / norm_r for n in ns]),
                      float(e @ r) / rr, rms([float(n @ r) / rr for n in ns]), r.numel())


def noise_rows(step: int, kind: str, tensors: dict[str, tuple], floor_min: float = 0.0,
               along: bool = True) -> list[Row]:
    """Rows for a low-precision run: per name pattern the worst tensor (by err/tol) of

        norm-wise    ||e|| / ||r||     <=  C_NORM  * max(floor, floor_min)
        along        |<e, r>| / <r, r>  <=  C_ALONG * max(along_noise, floor / sqrt(numel))

    `tensors`: name -> (actual, reference, [twins]). floor_min: the least floor (the loss: the
    logits', as a scalar's twins may land on the reference by chance). The along row is left
    out where the reference is mostly noise (floor > NOISY) and for scalars."""
    worst: dict[str, Row] = {}

    def keep(row: Row) -> None:
        prev = worst.get(row.quantity)
        if prev is None or _ratio(row) > _ratio(prev):
            worst[row.quantity] = row
    for name, (a, r, twins) in tensors.items():
        s = noise_stats(a, r, twins)
        floor = max(s.floor, floor_min)
        keep(Row(step, f"{kind} {pattern(name)}".strip(), s.norm, C_NORM * floor))
        if along and s.numel > 1 and floor <= NOISY:
            noise = max(s.along_noise, floor / s.numel ** 0.5)
            keep(Row(step, f"{kind} {pattern(name)} along".strip(), abs(s.along), C_ALONG * noise))
    return list(worst.values())


def sum_rows(step: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], tol: float) -> list[Row]:
    """Rows for whole tensors (logits, loss, dL/dX): rel_err against the reference."""
    return [Row(step, what, rel_err(a, e), tol) for what, (a, e) in pairs.items()]


# ---- replicas ---------------------------------------------------------------------------------
def replica_groups(rule: Rule, tied_across_stages: bool = False, over_dp: bool = True) -> list[str]:
    """The groups across which this parameter is held whole (and must stay identical).

    Not split along tp: replicated over tp. Every parameter is replicated over dp and cp (data
    and context parallelism copy the model), and every one but the experts' over ep (an
    expert-parallel rank holds other experts, but is a data-parallel replica of the dense
    layers); groups of one rank are skipped by the caller.
    A pipeline's tied word embedding, when the first and the last stage are on different ranks
    (both hold a copy: model/stages.py), is replicated over the "embedding"
    group. over_dp=False leaves dp out: tensors rebuilt from ZeRO shards (data_parallel.checks)
    are equal over their shard group by construction, so comparing them there would check
    nothing; across dp_replicate (HSDP) each copy is rebuilt apart, and compared.
    """
    groups = ["dp", "cp"] if over_dp else ["dp_replicate", "cp"]   # HSDP: rebuilt per shard group
    if over_dp and not rule.experts:   # an ep rank is a data-parallel replica of dense layers
        groups.append("ep")
    if rule.dim is None:
        groups.insert(0, "tp")
    if tied_across_stages and rule.name == "embedding.word.weight":
        groups.append("embedding")
    return groups


def replica_rows(step: int, kind: str, local: dict, cfg: ModelConfig, grid: Grid,
                 tied_across_stages: bool = False, over_dp: bool = True) -> list[Row]:
    """All-gather every replicated tensor over its group and compare bitwise (collective).

    One row: err = the largest relative difference between two copies (0 when identical),
    tol = 0, and the first offending tensor and ranks in `detail`. `local` may hold only some
    of the rules' tensors (a pipeline rank's stages): every rank in a group holds the same.
    """
    by_group: dict[str, list[str]] = {}
    for rule in rules(cfg):
        if rule.name in local:
            for g in replica_groups(rule, tied_across_stages, over_dp):
                if grid.groups[g].size > 1:
                    by_group.setdefault(g, []).append(rule.name)
    worst, detail = 0.0, ""
    for g, names in by_group.items():
        group = grid.groups[g]
        flat = torch.cat([local[n].detach().reshape(-1) for n in names])
        copies = comm.all_gather(flat.unsqueeze(0).contiguous(), group, dim=0)   # [size, numel]
        offset = 0
        for n in names:
            piece = copies[:, offset:offset + local[n].numel()]
            offset += local[n].numel()
            for r in range(1, group.size):
                if torch.equal(piece[r].view(torch.uint8), piece[0].view(torch.uint8)):
                    continue
                err = rel_err(piece[r], piece[0])
                err = err if err > 0 else math.inf       # differ in bits only (NaN payload, -0.0)
                if not detail or err > worst:
                    worst = err
                    detail = (f"{kind[:-1]} {n} differs between {g} ranks 0 and {r} (global ranks "
                              f"{group.global_rank(0)} and {group.global_rank(r)}): "
                              f"max rel diff {err:.2e}")
    return [Row(step, f"replicas {kind}", worst, 0.0, detail)]

