"""Planted wrong answer for exercises/12_composing_6d.ipynb: the order argument is ignored and
the ranks are always laid out in minitron's default tp-cp-ep-dp-pp. Every default-order value is
right; the first grid under tp-cp-ep-pp-dp already gets other coordinates (Check 1)."""

# answer-cell id -> the learner's WHOLE cell source
WRONG = {
    "c12s03": '''def coords(sizes, rank, order):
    out = {}
    for d in ("tp", "cp", "ep", "dp", "pp"):     # wrong: the default order, whatever `order` says
        rank, out[d] = divmod(rank, sizes[d])
    return out


def rank_of(sizes, coords, order):
    rank = 0
    for d in ("pp", "dp", "ep", "cp", "tp"):
        rank = rank * sizes[d] + coords[d]
    return rank


def group_of(sizes, rank, dims, order):
    mine = coords(sizes, rank, order)
    varying = [{}]
    for d in dims:
        varying = [dict(v, **{d: k}) for v in varying for k in range(sizes[d])]
    return sorted(rank_of(sizes, {**mine, **v}, order) for v in varying)
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
