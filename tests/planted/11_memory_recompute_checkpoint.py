"""Planted wrong answer for exercises/11_memory_recompute_checkpoint.ipynb: GQA is assumed to
shrink the saved keys and values to a_kv heads without recomputation, as it shrinks their
weights. minitron's attention_core expands K and V to a heads (repeat_interleave) and keeps
those copies, so every GQA layer measured without recomputation disagrees (Check 1)."""

WRONG = {
    "e110003": '''def layer_activation_bytes(b, s, h, a, a_kv, f, t=1, sp=False, recompute="none"):
    bsh = b * s * h
    if recompute == "full":
        return 4 * bsh // (t if sp else 1)
    region = (4 * bsh + 4 * b * s) // (t if sp else 1)
    gathered = 2 * bsh
    shard = (bsh + 4 * b * s * f) // t
    qkv = b * s * (a + 2 * a_kv) * (h // a) // t     # wrong without recomputation: K, V are kept expanded
    if recompute == "selective":
        return 4 * (region + gathered + shard + qkv)
    return 4 * (region + gathered + shard + qkv + 3 * a * s * s * b // t) + s * s
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
