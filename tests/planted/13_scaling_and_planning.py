"""Planted wrong answer for exercises/13_scaling_and_planning.ipynb: the TP term counts the forward's
and the backward's all-reduces but forgets the two of the recomputed forward, so every
configuration with full recomputation gets two thirds of the model's TP time."""

# answer-cell id -> the learner's WHOLE cell source
WRONG = {
    "c13s03": '''def tp_comm_seconds(b, s, h, t, recompute, bandwidth, latency):
    if t == 1:
        return 0.0
    all_reduces = 4                     # wrong: full recomputation reruns the forward's two
    nbytes = 2 * b * s * h
    return all_reduces * 2 * ((t - 1) / t * nbytes / bandwidth + (t - 1) * latency)
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
