"""Flash attention's GPU tiles: the lists autotune picks from, and the tiles dropped from them.

A tile is (BLOCK_M, BLOCK_N, warps, pipeline stages). The forward and dQ kernels need
BLOCK_M % BLOCK_N == 0, dK/dV needs BLOCK_N % BLOCK_M == 0. Every listed tile compiles for
sm_90 at head dims 64 and 128 within the 227 KiB of shared memory of an H100/H200 and
without register spills: tests/test_kernels_compile.py checks each one (compile_check.py).
fp32 inputs hold twice the bytes of 16-bit ones in every tile, hence lists of their own.

No triton here: the compile tests read these lists without importing the kernels (importing
them decides, for good, whether they run interpreted or compiled).
"""
KERNEL_NAMES = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}

CONFIGS = {
    ("fwd", "16bit"): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 4), (64, 32, 4, 4)],
    ("dkdv", "16bit"): [(16, 64, 8, 3), (16, 32, 8, 3), (32, 32, 4, 3), (32, 64, 8, 3), (32, 128, 8, 2)],
    ("dq", "16bit"): [(64, 32, 8, 3), (128, 32, 8, 2), (32, 32, 4, 3), (64, 64, 8, 3)],
    ("fwd", "fp32"): [(16, 16, 4, 2), (32, 16, 4, 2), (32, 32, 8, 2)],
    ("dkdv", "fp32"): [(16, 16, 4, 2), (16, 32, 4, 2), (32, 32, 8, 2)],
    ("dq", "fp32"): [(16, 16, 4, 2), (32, 16, 4, 2), (32, 32, 8, 2)],
}

# Tiles taken out of a list, with the limit each breaks at head dim 128 ("shared": more than
# 227 KiB; "spills": registers spilled). Compiled by the tests too: the checks must catch them.
REJECTED = {}
