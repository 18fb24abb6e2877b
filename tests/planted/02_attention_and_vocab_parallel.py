"""Planted wrong answer for exercises/02_attention_and_vocab_parallel.ipynb: the z-loss is taken
on log S, the shifted normaliser, instead of log Z = m + log S. The smoothed cross-entropy is
right, and so is the message count; the z-loss term is wrong wherever the max is not zero,
which Check 1a (one process) already shows."""

WRONG = {
    "3b9c4eac": '''def my_vocab_parallel_loss(logits_shard, targets, group, eps, lam):
    z = logits_shard.detach().float()
    v_local = z.shape[-1]
    vocab = v_local * group.size
    local = targets - group.rank * v_local
    mine = (local >= 0) & (local < v_local)

    m = z.max(dim=-1).values
    comm.all_reduce(m, group, op="max")
    z = z - m.unsqueeze(-1)

    picked = z.gather(-1, local.masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    expected = ((1 - eps) * picked + eps / vocab * z.sum(dim=-1)).contiguous()
    comm.all_reduce(expected, group, op="sum")

    sum_exp = z.exp().sum(dim=-1)
    comm.all_reduce(sum_exp, group, op="sum")
    log_s = sum_exp.log()
    return log_s - expected + lam * log_s ** 2      # wrong: log S is log Z - m
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1a"
