"""Planted wrong answer for exercises/09_context_parallel.ipynb: the merge's weights are treated
as constants in the backward, so dL/dl_r keeps only the w_r dL/dl term and loses
w_r dL/do . (o_r - o). With dL/dl = 0 it returns zero, where the by-hand blocks get -2.1 and
+2.1 (Check 1)."""

WRONG = {
    "c26f55af": '''def merge_backward(out_r, lse_r, out, lse, d_out, d_lse):
    w = torch.exp(lse_r - lse)[..., None]
    return w * d_out, w[..., 0] * d_lse          # wrong: o depends on l_r through the weights too
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
