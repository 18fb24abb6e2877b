"""Planted wrong answer for exercises/07_mixed_precision.ipynb: the share of skipped steps is
taken as 1 / growth_interval, forgetting that the overflowing step itself belongs to the cycle
(growth_interval good steps, then one skipped: 1 in growth_interval + 1). The settled scale is
right, so nothing crashes; Check 1's skipped shares catch it."""

WRONG = {
    "e07c0004": '''def loss_scale_cycle(g_max, growth_interval):
    scale = 2.0 ** math.floor(math.log2(65520 / g_max))
    if g_max * scale >= 65520:
        scale /= 2
    return scale, 1 / growth_interval       # wrong: the cycle has growth_interval + 1 steps
''',
}

FAILS_AT = "Check 1"
