"""Planted wrong answer for exercises/00_collectives.ipynb: the leftward half of the bidirectional
ring reuses the lesson's rightward chunk indices, (r-s-1) and (r-s-2), where the mirrored ring
needs (r+s+1) and (r+s+2) (and (r+s), (r+s+1) in the all-gather). Every message has the right
size and goes to the right neighbour, so it runs without an error or a hang and counts the right
steps and bytes; but from three ranks on, the chunks that arrive from the right are added into the
wrong slots, and Check 1's results differ from comm.all_reduce. (On two ranks both directions
coincide and it is right.)"""

WRONG = {
    "52966923": '''def bidirectional_ring_all_reduce(t: torch.Tensor, group: comm.Group) -> torch.Tensor:
    "The element-wise sum of t over the group: one half round the ring each way, both at once."
    n, r = group.size, group.rank
    if n == 1:
        return t.clone()
    first, second = t.reshape(-1).chunk(2)
    cw = [c.clone() for c in first.chunk(n)]
    ccw = [c.clone() for c in second.chunk(n)]
    right, left = (r + 1) % n, (r - 1) % n

    def step(out_c, in_c, add):
        from_left, from_right = torch.empty_like(cw[in_c]), torch.empty_like(ccw[in_c])
        comm.exchange([comm.P2P("send", cw[out_c], right), comm.P2P("send", ccw[out_c], left),
                       comm.P2P("recv", from_left, left), comm.P2P("recv", from_right, right)], group)
        if add:
            cw[in_c] += from_left
            ccw[in_c] += from_right        # wrong: the leftward ring's chunks are mirrored
        else:
            cw[in_c], ccw[in_c] = from_left, from_right

    for s in range(n - 1):
        step((r - s - 1) % n, (r - s - 2) % n, add=True)
    for s in range(n - 1):
        step((r - s) % n, (r - s - 1) % n, add=False)
    return torch.cat(cw + ccw).reshape(t.shape)
''',
}

FAILS_AT = "Check 1"
