"""Planted wrong answer for exercises/05_zero_bubble.ipynb: lesson 05's ZB-H1 handed in as it is
(1F1B's order with B and W split, rank r holding back its first r W's). It is valid and keeps
at most p micro-batches alive, so Checks 1 and 2 pass; but it runs no extra forwards in the
warm-up, so gaps stay inside the ranks' spans (p-1 on the busiest): Check 3 catches it."""

WRONG = {
    "s05c03": '''def no_gap_orders(pp, m):
    orders = {}
    for rank in range(pp):
        warmup = min(pp - 1 - rank, m)
        one_f_one_b = [Action(F, i, rank) for i in range(warmup)]
        for i in range(m - warmup):
            one_f_one_b += [Action(F, i + warmup, rank), Action(B, i, rank)]
        one_f_one_b += [Action(B, i, rank) for i in range(m - warmup, m)]
        order, waiting = [], []
        for a in one_f_one_b:
            order.append(a)
            if a.kind == B:
                waiting.append(Action(W, a.microbatch, rank))
                if a.microbatch >= rank:
                    order.append(waiting.pop(0))
        orders[rank] = order + waiting
    return orders
''',
}

FAILS_AT = "Check 3"
