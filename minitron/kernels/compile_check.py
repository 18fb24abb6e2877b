"""Every kernel compiled for a Hopper GPU (sm_90) on any machine, with what ptxas reports.

    python -m minitron.kernels.compile_check [--json] [--only SUBSTRING ...]

Triton's CUDA backend, ptxas included, ships in its wheel and needs no GPU to compile, so this
runs the whole compiler down to a cubin for each case below, then asks ptxas (-v) for the
registers a thread uses and the bytes it spills to local memory. The shared memory a block
needs is Triton's own figure (its kernels allocate it dynamically, so ptxas does not see it);
a launch asking for more than SM90_SHARED_LIMIT fails on an H100/H200.

Flash attention is compiled in every tile autotune may pick (attention_configs.py), at head
dim 128, for 16-bit and fp32 inputs: what tests/test_kernels_compile.py holds to the
limits; and in the tiles dropped from those lists, which must break them.

The cases compile in parallel, one process per CPU. Run it in a fresh process with
TRITON_INTERPRET unset (the tests do): triton.jit decides
between interpreter and compiler when it decorates a kernel, and an interpreted kernel cannot
be compiled.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from .attention_configs import CONFIGS, KERNEL_NAMES, REJECTED

SM90_SHARED_LIMIT = 227 * 1024   # bytes of shared memory one block may use on an H100/H200
BF, F32 = "*bf16", "*fp32"
_ROW = dict(X=BF, W=BF, B=BF, Y=BF, DY=BF, DX=BF, RSTD=F32, MEAN=F32, DW_PART=F32, DB_PART=F32,
            eps="fp32", scale="fp32")
# name: (module, kernel, pointer and float argument types (the rest are i32), constexprs, warps, stages)
OTHER_CASES = {
    "rmsnorm fwd": ("rmsnorm", "_rmsnorm_fwd", _ROW, dict(BLOCK_N=4096), 8, 3),
    "rmsnorm bwd": ("rmsnorm", "_rmsnorm_bwd", _ROW, dict(BLOCK_N=4096), 16, 3),
    "layernorm fwd": ("layernorm", "_layernorm_fwd", _ROW, dict(BLOCK_N=4096), 8, 3),
    "layernorm bwd": ("layernorm", "_layernorm_bwd", _ROW, dict(BLOCK_N=4096), 16, 3),
    "softmax fwd": ("softmax", "_softmax_fwd", _ROW, dict(CAUSAL=True, BLOCK=1024), 4, 3),
    "softmax bwd": ("softmax", "_softmax_bwd", _ROW, dict(BLOCK=1024), 4, 3),
    "ce partials": ("cross_entropy", "_ce_partials", dict(X=BF, TARGETS="*i64", MAX=F32, SUMEXP=F32,
                                                         TGT_LOGIT=F32), dict(BLOCK_V=4096), 8, 3),
    "ce grad": ("cross_entropy", "_ce_grad", dict(X=BF, TARGETS="*i64", MAX=F32, LOGSUM=F32,
                                                  DLOSS=F32, DX=BF), dict(BLOCK_V=4096), 8, 3),
    "swiglu fwd": ("gated_mlp", "_swiglu_fwd", dict(G=BF, U=BF, O=BF), dict(BLOCK=1024), 4, 3),
    "swiglu bwd": ("gated_mlp", "_swiglu_bwd", dict(G=BF, U=BF, DO=BF, DG=BF, DU=BF),
                   dict(BLOCK=1024), 4, 3),
    "gelu fwd": ("gated_mlp", "_bias_gelu_fwd", dict(X=BF, B=BF, O=BF), dict(TANH=False, BLOCK=1024), 4, 3),
    "gelu bwd tanh": ("gated_mlp", "_bias_gelu_bwd", dict(X=BF, B=BF, DO=BF, DX=BF),
                      dict(TANH=True, BLOCK=1024), 4, 3),
    "adamw": ("adamw", "_adamw_kernel", dict(P=F32, G=BF, M=F32, V=F32, OUT=BF, decay="fp32", w1="fp32",
                                             beta2="fp32", one_minus_beta2="fp32", eps="fp32",
                                             step_size="fp32", bc2_sqrt="fp32"),
              dict(LERP_FROM_END=False, HAS_OUT=True, BLOCK=1024), 4, 3),
    "attention delta": ("flash_attention", "_bwd_delta", dict(O=BF, DO=BF, DELTA=F32),
                        dict(HEAD_DIM=128, BLOCK=32), 4, 3),
}
HEAD_DIMS = (128,)   # the largest the lists serve: d = 64 needs less of everything


def _attention_case(kernel, width, d, tile):
    bm, bn, warps, stages = tile
    ptr = F32 if width == "fp32" else BF
    types = dict(Q=ptr, K=ptr, V=ptr, O=ptr, DO=ptr, DK=ptr, DV=ptr, DQ=ptr, LSE=F32, DELTA=F32,
                 qk_scale="fp32", sm_scale="fp32")
    flags = dict(CAUSAL=True, EVEN_N=True, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                 PREC="ieee" if width == "fp32" else "tf32")
    name = f"attention {kernel} {width} d{d} {bm}x{bn} w{warps} s{stages}"
    return name, ("flash_attention", KERNEL_NAMES[kernel], types, flags, warps, stages)


def attention_cases():
    """Every flash-attention kernel in every tile of its lists, per input width and head dim."""
    return dict(_attention_case(kernel, width, d, tile) for (kernel, width), table in CONFIGS.items()
                for d in HEAD_DIMS for tile in table)


def rejected_cases():
    """The tiles taken out of the lists, at head dim 128: {name: case}, {name: limit broken}."""
    cases, why = {}, {}
    for (kernel, width), table in REJECTED.items():
        for tile, reason in table:
            name, case = _attention_case(kernel, width, 128, tile)
            cases[name], why[name] = case, reason
    return cases, why


REJECTED_REASONS = rejected_cases()[1]


def all_cases():
    return {**OTHER_CASES, **attention_cases(), **rejected_cases()[0]}


def all_case_names():
    return list(all_cases())


def _ptxas():
    """The ptxas Triton itself runs for sm_90 (its wheel carries more than one)."""
    from triton.backends.nvidia import compiler as nv
    try:
        tool = nv.get_ptxas(90)
    except TypeError:    # a Triton whose get_ptxas takes no architecture
        tool = nv.get_ptxas()
    tool = getattr(tool, "path", tool)
    return tool[0] if isinstance(tool, tuple) else tool


def ptxas_report(ptx):
    """(registers, spilled bytes) of the PTX's kernel, compiled the way Triton compiles it."""
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([_ptxas(), "-v", f"--gpu-name={arch}", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


def compile_case(module, kernel, types, constexprs, warps, stages):
    """Compile one kernel for sm_90; its registers, spilled bytes, shared memory, cubin size."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(f"minitron.kernels.{module}"), kernel)
    if not hasattr(fn, "arg_names"):
        raise RuntimeError("the kernels were loaded interpreted: unset TRITON_INTERPRET")
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})
    regs, spills = ptxas_report(compiled.asm["ptx"])
    return {"registers": regs, "spill_bytes": spills, "shared_bytes": compiled.metadata.shared,
            "cubin_bytes": len(compiled.asm.get("cubin") or b"")}


def _compile_or_error(case):
    try:
        return compile_case(*case)
    except Exception as e:  # one case's failure is that case's result, not the end of the run
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def run(only=(), show=None):
    """{case name: report, or {"error": message}} for the cases whose name contains any of
    `only` (all when empty), compiled on every CPU; show(name, report) as each one is done."""
    import concurrent.futures as cf
    import multiprocessing
    cases = {name: case for name, case in all_cases().items() if not only or any(s in name for s in only)}
    workers = min(len(cases), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    results = {}
    with cf.ProcessPoolExecutor(max(workers, 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile_or_error, case): name for name, case in cases.items()}
        for future in cf.as_completed(futures):
            results[futures[future]] = future.result()
            if show:
                show(futures[future], results[futures[future]])
    return {name: results[name] for name in cases}


def _show(name, r):
    if "error" in r:
        print(f"{name:<44} ERROR {r['error'].splitlines()[0]}", flush=True)
        return
    over = "  OVER the sm_90 limit" if r["shared_bytes"] > SM90_SHARED_LIMIT else ""
    print(f"{name:<44} {r['registers']:>4} regs {r['spill_bytes']:>6} B spilled "
          f"{r['shared_bytes'] / 1024:>7.1f} KiB shared{over}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minitron.kernels.compile_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object, case name -> report")
    p.add_argument("--only", nargs="*", default=(), help="cases whose name contains one of these")
    args = p.parse_args(argv)
    results = run(args.only, show=None if args.json else _show)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
