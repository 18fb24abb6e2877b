"""Planted wrong answer for exercises/05_zero_bubble.ipynb: B and W split, but no W held back
(each W right after its B). The schedule is valid and keeps 1F1B's memory, so Checks 1 and 2
pass; the bubble is (p-1)(F+B), two thirds of 1F1B's instead of a third: Check 3 catches it."""

WRONG = {
    "s05c03": '''def zb_h1_order(pp, m, rank):
    warmup = min(pp - 1 - rank, m)
    order = [Action(F, i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(F, i + warmup, rank), Action(B, i, rank), Action(W, i, rank)]
    for i in range(m - warmup, m):
        order += [Action(B, i, rank), Action(W, i, rank)]
    return order
''',
}

FAILS_AT = "Check 3"
