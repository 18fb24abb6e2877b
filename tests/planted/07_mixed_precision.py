"""Planted wrong answer for exercises/07_mixed_precision.ipynb: an overflow halves the scale but
does not restart the count of good steps, so the scale doubles too early after it. Check 1's
third sequence (two good steps, an overflow, then one good step reaches the interval of 3)
catches it."""

WRONG = {
    "e07c0004": '''def next_scale(scale, good_steps, overflow, growth_interval, min_scale):
    if overflow:
        return max(scale / 2, min_scale), good_steps    # wrong: the run of good steps goes on
    good_steps += 1
    if good_steps == growth_interval:
        return scale * 2, 0
    return scale, good_steps
''',
}

FAILS_AT = "Check 1"
