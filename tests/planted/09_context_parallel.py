"""Planted wrong answer for exercises/09_context_parallel.ipynb: the blocks' outputs are added
as they come, without rescaling each by its share of the softmax mass, exp(lse_block - lse)
(each block's output is normalised within its own block only). The log-sum-exp is right, so
nothing crashes; Check 1's by-hand value (54.6212 instead of 34.9265) catches it. (Part 2, the
ring's blocks, is checked by Check 2: a list that thinks of whole ranks instead of chunks, all
or nothing by owner as in a contiguous split, prints "the causal triangle once: False".)"""

WRONG = {
    "c26f55af": '''def merge_partials(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a + out_b, lse
''',
}

FAILS_AT = "Check 1"
