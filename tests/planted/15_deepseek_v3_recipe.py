"""Planted wrong answer for exercises/15_deepseek_v3_recipe.ipynb: every tile gets the tensor's
scale, 448 / amax of the whole activation (per-tensor scaling under a tile's name). The shape is
right and the cast round-trips, but the scales differ from the tiles' own, which Check 1 shows."""

WRONG = {
    "c15s03": '''def tile_scales(x, tile):
    rows, cols = x.shape
    tiles = -(-cols // tile)
    a = x.abs().max().float()                    # wrong: the whole tensor's amax, not the tile's
    return torch.full((rows, tiles), fp8_max(E4M3)) / a
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
