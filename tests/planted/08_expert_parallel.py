"""Planted wrong answer for exercises/08_expert_parallel.ipynb: the permutation sorts every
pair by expert but forgets the capacity's drops (`keep`), so dropped pairs are sent, computed
and added back. Check 1's hand-made example, with one dropped pair, catches it."""

WRONG = {
    "c23dfea5": '''def permute(experts, keep):
    flat = experts.reshape(-1)
    return torch.sort(flat, stable=True).indices          # wrong: the dropped pairs are kept


def split_sizes(pair_experts, n_experts, ep):
    counts = torch.bincount(pair_experts, minlength=n_experts)
    return counts, counts.view(ep, -1).sum(1).tolist()
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
