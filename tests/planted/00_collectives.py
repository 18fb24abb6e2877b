"""Planted wrong answer for exercises/00_collectives.ipynb: the ring's all-gather phase stops one
step early (range(n - 2)), so on every rank one chunk keeps its partial sum instead of the
complete one. It runs without an error and sends 2(n-1) - 1 messages; Check 1 compares the
result with comm.all_reduce and counts the sends and bytes."""

WRONG = {
    "52966923": '''def ring_all_reduce(t: torch.Tensor, group: comm.Group) -> torch.Tensor:
    "The element-wise sum of t over the group, on every rank, from point-to-point messages only."
    n, r = group.size, group.rank
    if n == 1:
        return t.clone()
    chunks = [c.clone() for c in t.reshape(-1).chunk(n)]
    right, left = (r + 1) % n, (r - 1) % n

    def step(out_c, in_c, add):
        incoming = torch.empty_like(chunks[in_c])
        comm.exchange([comm.P2P("send", chunks[out_c], right), comm.P2P("recv", incoming, left)], group)
        if add:
            chunks[in_c] += incoming
        else:
            chunks[in_c] = incoming

    for s in range(n - 1):  # reduce-scatter
        step((r - s - 1) % n, (r - s - 2) % n, add=True)
    for s in range(n - 2):  # all-gather, one step short
        step((r - s) % n, (r - s - 1) % n, add=False)
    return torch.cat(chunks).reshape(t.shape)
''',
}

FAILS_AT = "Check 1"
