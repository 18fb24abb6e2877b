"""Planted wrong answer for exercises/06_data_parallel_and_zero.ipynb: fp32 training counted with
lesson 06's bf16 optimizer (12 bytes per parameter: a master copy beside Adam's moments), where
an fp32 weight needs no second copy and the optimizer holds 8. Check 1's stage 0 row catches it."""

WRONG = {
    "e06c0004": '''def fp32_state_bytes(psi, n, stage):
    shard = lambda nbytes, from_stage: nbytes * psi // n if stage >= from_stage else nbytes * psi
    return shard(4, 3), shard(4, 2), shard(12, 1)      # wrong: a master copy fp32 does not need
''',
}

FAILS_AT = "Check 1"
