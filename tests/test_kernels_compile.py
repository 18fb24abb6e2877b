"""Every kernel compiled for a Hopper GPU (sm_90), on any machine.

The interpreter runs kernels as Python, so it accepts code the real compiler
rejects (types that do not unify across a loop, unsupported ops, blocks that
do not fit shared memory). Triton's CUDA backend, ptxas included, ships in its
wheel and needs no GPU to compile, so these tests run the whole compiler down
to a cubin for one representative configuration of each kernel.
"""
import importlib.util
import os
import sys

import pytest

triton = pytest.importorskip("triton")

NAMES = ["rmsnorm", "layernorm", "softmax", "flash_attention", "cross_entropy", "gated_mlp", "adamw"]


@pytest.fixture(scope="module")
def compiled_kernels():
    """Fresh copies of the kernel modules, loaded with the interpreter off (the
    installed modules may already be interpreted ones, if other tests ran first)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton has no compiler API here: {e}")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this triton has no CUDA backend")
    import minitron.kernels as pkg
    saved = os.environ.pop("TRITON_INTERPRET", None)
    already = set(sys.modules)
    try:
        modules = {}
        for name in NAMES:
            path = os.path.join(os.path.dirname(pkg.__file__), f"{name}.py")
            spec = importlib.util.spec_from_file_location(f"minitron.kernels.{name}", path,
                                                          submodule_search_locations=None)
            module = importlib.util.module_from_spec(spec)
            module.__package__ = "minitron.kernels"
            spec.loader.exec_module(module)
            modules[name] = module
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
        # A kernel file's own imports (layernorm's `from .rmsnorm import ...`) registered
        # compiled modules under the package: drop them, so tests that run later import
        # their own (interpreted) copies instead of these.
        for name in set(sys.modules) - already:
            if name.startswith("minitron.kernels."):
                del sys.modules[name]
                if hasattr(pkg, name.rsplit(".", 1)[1]):
                    delattr(pkg, name.rsplit(".", 1)[1])

    def compile_for_sm90(fn, types, constexprs, num_warps=4, num_stages=3):
        if not hasattr(fn, "arg_names"):
            pytest.skip("kernels were loaded as interpreted functions")
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                     for name in fn.arg_names}
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "enable_fp_fusion": True})

    return modules, compile_for_sm90


BF, F32 = "*bf16", "*fp32"
ROW = dict(X=BF, W=BF, B=BF, Y=BF, DY=BF, DX=BF, RSTD=F32, MEAN=F32, DW_PART=F32, DB_PART=F32,
           eps="fp32", scale="fp32")
CASES = {
    "rmsnorm fwd": ("rmsnorm", "_rmsnorm_fwd", ROW, dict(BLOCK_N=4096), 8),
    "rmsnorm bwd": ("rmsnorm", "_rmsnorm_bwd", ROW, dict(BLOCK_N=4096), 16),
    "layernorm fwd": ("layernorm", "_layernorm_fwd", ROW, dict(BLOCK_N=4096), 8),
    "layernorm bwd": ("layernorm", "_layernorm_bwd", ROW, dict(BLOCK_N=4096), 16),
    "softmax fwd": ("softmax", "_softmax_fwd", ROW, dict(CAUSAL=True, BLOCK=1024), 4),
    "softmax bwd": ("softmax", "_softmax_bwd", ROW, dict(BLOCK=1024), 4),
    "ce partials": ("cross_entropy", "_ce_partials", dict(X=BF, TARGETS="*i64", MAX=F32, SUMEXP=F32,
                                                         TGT_LOGIT=F32), dict(BLOCK_V=4096), 8),
    "ce grad": ("cross_entropy", "_ce_grad", dict(X=BF, TARGETS="*i64", LSE=F32, DLOSS=F32, DX=BF),
                dict(BLOCK_V=4096), 8),
    "swiglu fwd": ("gated_mlp", "_swiglu_fwd", dict(G=BF, U=BF, O=BF), dict(BLOCK=1024), 4),
    "swiglu bwd": ("gated_mlp", "_swiglu_bwd", dict(G=BF, U=BF, DO=BF, DG=BF, DU=BF), dict(BLOCK=1024), 4),
    "gelu fwd": ("gated_mlp", "_bias_gelu_fwd", dict(X=BF, B=BF, O=BF), dict(TANH=False, BLOCK=1024), 4),
    "gelu bwd tanh": ("gated_mlp", "_bias_gelu_bwd", dict(X=BF, B=BF, DO=BF, DX=BF),
                      dict(TANH=True, BLOCK=1024), 4),
    "adamw": ("adamw", "_adamw_kernel", dict(P=F32, G=BF, M=F32, V=F32, OUT=BF, decay="fp32", w1="fp32",
                                             beta2="fp32", one_minus_beta2="fp32", eps="fp32",
                                             step_size="fp32", bc2_sqrt="fp32"),
              dict(LERP_FROM_END=False, HAS_OUT=True, BLOCK=1024), 4),
}
ATTN = dict(Q=BF, K=BF, V=BF, O=BF, LSE=F32, DO=BF, DELTA=F32, DK=BF, DV=BF, DQ=BF,
            qk_scale="fp32", sm_scale="fp32")
FLAGS = dict(CAUSAL=True, EVEN_N=True, HEAD_DIM=128, PREC="tf32")
CASES.update({
    "attention fwd": ("flash_attention", "_attn_fwd", ATTN, dict(FLAGS, BLOCK_M=128, BLOCK_N=64), 8),
    "attention dkdv": ("flash_attention", "_attn_bwd_dkdv", ATTN, dict(FLAGS, BLOCK_M=16, BLOCK_N=64), 4),
    "attention dq": ("flash_attention", "_attn_bwd_dq", ATTN, dict(FLAGS, BLOCK_M=64, BLOCK_N=32), 4),
    "attention delta": ("flash_attention", "_bwd_delta", ATTN, dict(HEAD_DIM=128, BLOCK=32), 4),
})


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_sm90(compiled_kernels, case):
    modules, compile_for_sm90 = compiled_kernels
    module, kernel, types, constexprs, warps = CASES[case]
    compiled = compile_for_sm90(getattr(modules[module], kernel), types, constexprs, warps)
    assert compiled.asm.get("cubin"), "no cubin came out"
