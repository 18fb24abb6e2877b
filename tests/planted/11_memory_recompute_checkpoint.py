"""Planted wrong answer for exercises/11_memory_recompute_checkpoint.ipynb: under sequence
parallelism the QKV and fc1 inputs are divided by t as well (Megatron's re-gather accounting,
not what minitron keeps: it saves the all-gathered inputs whole). Without SP every count is
right; Check 1 catches it on the layers measured with SP (t=2 and t=4)."""

WRONG = {
    "e110003": '''def layer_activation_bytes(b, s, h, a, t=1, sp=False, recompute="none"):
    region = t if sp else 1
    if recompute == "full":
        return 4 * b * s * h // region
    elements = (2 * b * s * h // region
                + 2 * b * s * h // region        # wrong: minitron keeps the gathered inputs whole
                + 3 * b * s * h // t
                + b * s * h // t
                + 8 * b * s * h // t
                + 2 * b * s * h // region
                + 4 * b * s // region)
    if recompute == "selective":
        return 4 * elements
    scores = 3 * a * s * s * b // t
    return 4 * (elements + scores) + s * s
''',
}

FAILS_AT = "Check 1"
