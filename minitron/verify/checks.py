"""The comparisons behind minitron.verify, under the one name the tests, lessons and benchmarks
import them by. Each lives in a file of its own:

    tolerances.py     the float32 bars: C * sqrt(K) * eps32 for sums, 16 eps32 for updates
    report.py         Row (one comparison) and Report (the table and the PASS/FAIL verdict)
    float32_rows.py   gradients, whole tensors and updates held to those bars
    noise_rows.py     low precision: errors held to the noise of the same precision
    replica_rows.py   tensors a group holds whole, bitwise equal across it
"""
from __future__ import annotations

from .float32_rows import grad_rows, pattern, sum_rows, ulp, update_err, update_rows
from .noise_rows import C_ALONG, C_NORM, C_SCALE, NOISY, NoiseStats, noise_rows, noise_stats
from .replica_rows import replica_groups, replica_rows
from .report import Report, Row
from .tolerances import (C_SUM, C_UPDATE, EPS32, FLOOR, ULP_SLACK, float32_tolerance, longest_sum,
                         update_tolerance)

__all__ = ["EPS32", "C_SUM", "C_UPDATE", "ULP_SLACK", "FLOOR", "longest_sum", "float32_tolerance",
           "update_tolerance", "Row", "Report", "pattern", "grad_rows", "ulp", "update_err",
           "update_rows", "sum_rows", "C_NORM", "C_ALONG", "C_SCALE", "NOISY", "NoiseStats", "noise_stats",
           "noise_rows", "replica_groups", "replica_rows"]
