"""Planted wrong answer for exercises/02_attention_and_vocab_parallel.ipynb: the forward pass
subtracts each rank's own max and never all-reduces it. On one rank (Check 1a) that is the
global max and the loss is right; on 2 and 4 ranks (Check 1b) the ranks' exp-sums and target
logits are taken against different offsets, and the loss is wrong (with two all-reduces, not
three)."""

WRONG = {
    "3b9c4eac": '''def my_vocab_parallel_cross_entropy(logits_shard, targets, group):
    z = logits_shard.detach().float()
    v_local = z.shape[-1]
    vocab_start = group.rank * v_local

    m = z.max(dim=-1).values                       # this rank's max only: not all-reduced
    z = z - m.unsqueeze(-1)

    local = targets - vocab_start
    mine = (local >= 0) & (local < v_local)
    picked = z.gather(-1, local.masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1)
    target_logit = picked.masked_fill(~mine, 0.0).contiguous()
    comm.all_reduce(target_logit, group, op="sum")

    sum_exp = z.exp().sum(dim=-1)
    comm.all_reduce(sum_exp, group, op="sum")
    return sum_exp.log() - target_logit
''',
}

FAILS_AT = "Check 1b"
