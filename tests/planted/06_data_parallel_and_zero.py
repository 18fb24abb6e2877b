"""Planted wrong answer for exercises/06_data_parallel_and_zero.ipynb: ZeRO-3's traffic taken
from lesson 06's one-micro-batch table (1.5 times plain DP) without the micro-batches: the
weights are gathered again for every forward and backward, so at m = 2 the count is twice that.
Check 1's stage 3, m=2 row catches it."""

WRONG = {
    "e06c0004": '''def zero_wire_bytes(psi, n, stage, microbatches):
    ring = (n - 1) / n * 2 * psi
    if stage < 3:
        return 2 * ring
    return 3 * ring                      # wrong: once per step, as if there were one micro-batch
''',
}

FAILS_AT = "Check 1"
