"""Planted wrong answer for exercises/12_composing_6d.ipynb: the ranks laid out tp-cp-dp-ep-pp,
dp varying faster than ep (Megatron-Core's dense order with ep slotted in after dp), so every
configuration with both ep > 1 and dp > 1 gets coordinates and groups that minitron.grid does not."""

# answer-cell id -> the learner's WHOLE cell source
WRONG = {
    "c12s03": '''ORDER = ("tp", "cp", "dp", "ep", "pp")   # wrong: dp before ep


def coords(sizes, rank):
    out = {}
    for d in ORDER:
        rank, out[d] = divmod(rank, sizes[d])
    return out


def group_of(sizes, rank, dims):
    mine = coords(sizes, rank)
    world = 1
    for d in ORDER:
        world *= sizes[d]
    return sorted(r for r in range(world)
                  if all(coords(sizes, r)[d] == mine[d] for d in ORDER if d not in dims))
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
