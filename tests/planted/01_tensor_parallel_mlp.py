"""Planted wrong answer for exercises/01_tensor_parallel_mlp.ipynb: the fused single-device fc1
[gate; up] cut into t contiguous blocks, as lesson 01 cut A by columns. On two ranks rank 0 then
holds all of gate and rank 1 all of up, so each rank's gated product multiplies gate entries by
gate entries (or up by up). It runs without an error, with the right shapes and collectives, and
is right on one rank; Check 1's rows held catch it at t = 2. Part 2's forward is the solution's."""

WRONG = {
    "cb02463a": '''def fused_fc1_shard(gate: nn.Linear, up: nn.Linear, t: int, i: int):
    "Rank i's fused [gate; up] weight and bias: everything its block of the inner width needs, for one GEMM."
    m = gate.out_features
    if m % t:
        raise ValueError(f"the inner width {m} is not divisible by the {t} tensor-parallel ranks")
    weight = torch.cat([gate.weight, up.weight]).chunk(t)[i]      # wrong: fuse first, then cut
    bias = torch.cat([gate.bias, up.bias]).chunk(t)[i]
    return weight, bias
''',
}

FAILS_AT = "Check 1"
