"""Planted wrong answer for exercises/13_scaling_and_planning.ipynb: the weak-scaling efficiency
is taken as the time ratio T1/Tn, which is right only when the work per device stays the same.
Here it falls as n grows (the attention core and the logits grow as h, not h^2), so the
efficiency is not the time ratio (Check 1)."""

WRONG = {
    "c13s03": '''def scaling_table(ns, model_flops, seconds, peak):
    per_device = [f / t / n for n, f, t in zip(ns, model_flops, seconds)]
    ratio = [seconds[0] / t for t in seconds]
    return {"time ratio": ratio, "efficiency": ratio,         # wrong: the work per device changed
            "mfu": [x / peak for x in per_device]}
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
