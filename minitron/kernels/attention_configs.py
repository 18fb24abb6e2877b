"""Flash attention's GPU tiles: the lists autotune picks from, and the tiles dropped from them.

A tile is (BLOCK_M, BLOCK_N, warps, pipeline stages). The forward and dQ kernels need
BLOCK_M % BLOCK_N == 0, dK/dV needs BLOCK_N % BLOCK_M == 0. Every listed tile compiles for
sm_90 at head dim 128 (64 needs less of everything) within the 227 KiB of shared memory of an
H100/H200 and without register spills: tests/test_kernels_compile.py checks each one with
ptxas (compile_check.py). fp32 inputs take twice the bytes of 16-bit ones, and their exact
("ieee") products run on the CUDA cores, not the tensor cores, with the whole head dimension
of both operands in registers: only small tiles fit, hence lists of their own.

No triton here: the compile tests read these lists without importing the kernels (importing
them decides, for good, whether they run interpreted or compiled).
"""
KERNEL_NAMES = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}

CONFIGS = {
    ("fwd", "16bit"): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (64, 32, 4, 4)],
    ("dkdv", "16bit"): [(16, 32, 8, 3), (32, 32, 4, 3)],
    ("dq", "16bit"): [(64, 32, 8, 3), (128, 32, 8, 2), (32, 32, 4, 3), (64, 64, 8, 3)],
    # fp32 is the verifier's exact path, not a fast one (16-bit is what trains): one small tile
    # each, which also keeps the cold-cache compile test short (an fp32 tile takes 4-8 s).
    ("fwd", "fp32"): [(16, 16, 4, 2)],
    ("dkdv", "fp32"): [(16, 16, 4, 2)],
    ("dq", "fp32"): [(16, 16, 4, 2)],
}

# Tiles taken out of a list, with the limit each breaks at head dim 128 ("shared": more than
# 227 KiB; "spills": registers spilled), measured with triton 3.9's ptxas. The tests compile
# this one too: the checks must catch it. Also taken out, not recompiled by the tests (slow):
# 16-bit fwd 128x128 w8 s2 (228 B spilled), dK/dV 16x64 w8 s3 (40 B) and 32x128 w8 s2 (156 B);
# fp32 (formerly the 16-bit lists) fwd 128x64 w8 s3 (224.5 KiB shared, 40 KB spilled) and
# 64x32 w4 s4 (80 KB spilled), fwd 32x32 w8 s2 (1264 B), dQ 32x16 w4 s2 (484 B), dK/dV 16x32 w8
# s2 (100 B), fwd 32x16 w4 s2 (1000 B). Spill-free but dropped to keep one fp32 tile per kernel:
# fwd 32x16 w8 s2, dQ 32x16 w8 s2, dK/dV 16x32 w4 s2 and 32x32 w8 s2.
REJECTED = {
    ("dkdv", "16bit"): [((32, 64, 8, 3), "spills")],   # 255 registers and 32 B spilled
}
