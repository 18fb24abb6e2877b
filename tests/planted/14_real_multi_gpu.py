"""Planted wrong answer for exercises/14_real_multi_gpu.ipynb: the whole tensor is all-reduced
inside the node and then across the nodes. The sums are right, but every rank sends the whole
payload over the slow links instead of its 1/L shard, which the counted bytes show (Check 1)."""

WRONG = {
    "c14s03": '''def two_level_all_reduce(t, node_group, cross_group):
    total = comm.all_reduce(t.clone(), node_group)      # wrong: the whole payload, not a shard
    return comm.all_reduce(total, cross_group)
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
