"""Planted wrong answer for exercises/00_collectives.ipynb (provisional, written against the
solution of 30 Nov 2026): the ring returns its input unchanged, the repro of issue 6 §1.
Check 1 compares it with comm.all_reduce on 2, 3 and 4 ranks and counts its messages."""

WRONG = {
    "52966923": '''def ring_all_reduce(t: torch.Tensor, group: comm.Group) -> torch.Tensor:
    "The element-wise sum of t over the group, on every rank, from point-to-point messages only."
    return t.clone()
''',
}

FAILS_AT = "Check 1"
