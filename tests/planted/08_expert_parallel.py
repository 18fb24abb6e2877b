"""Planted wrong answer for exercises/08_expert_parallel.ipynb: each slice starts its queues
from zero, as if it held the whole sequence (the offsets from the ranks before it are left out),
so a later slice keeps pairs that one device drops. Check 1's hand-made offsets catch it."""

WRONG = {
    "c23dfea5": '''def sequence_counts(experts, rows, n_experts):
    chosen = torch.nn.functional.one_hot(experts, n_experts).sum(1)
    return chosen.view(rows, -1, n_experts).sum(1)


def keep_pairs(experts, rows, cap, offsets):
    n_experts = offsets.shape[-1]
    chosen = torch.nn.functional.one_hot(experts, n_experts).sum(1).view(rows, -1, n_experts)
    place = chosen.cumsum(1).view(-1, n_experts)          # wrong: the earlier ranks' pairs are ignored
    return place.gather(-1, experts) <= cap


def slice_keep(experts, rows, cap, n_experts, group):
    counts = sequence_counts(experts, rows, n_experts)
    every = comm.all_gather(counts[None], group, dim=0)
    return keep_pairs(experts, rows, cap, every[:group.rank].sum(0))


def gather_bytes(rows, n_experts, ranks):
    return (ranks - 1) * rows * n_experts * 8
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
