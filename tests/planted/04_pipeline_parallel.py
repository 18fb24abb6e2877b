"""Planted wrong answer for exercises/04_pipeline_parallel.ipynb: the interleaved bubble derived
as if each rank still ran whole stages. Rank r waits r forwards of a whole stage before its first
action and r full backwards after its last, and (p-1-r) of both in between, each undivided by v.
Plain 1F1B (v = 1) comes out right, so Check 2's first cases agree; its first interleaved case
(pp=4, m=8, v=2) does not. Part 1's idle_parts is the solution's, so Check 1 passes."""

WRONG = {
    "e04c0008": '''def interleaved_idle(pp, m, v, F, B, W):
    if v > 1 and B + W != 2 * F:
        raise ValueError("no closed form: B + W != 2F")
    return {r: (r * F, (pp - 1 - r) * (F + B + W), r * (B + W)) for r in range(pp)}   # wrong: not / v
''',
}

FAILS_AT = "Check 2"
