"""Benchmark of the fused kernels on a GPU: python -m minitron.bench kernels [--csv PATH]

For each kernel at a few realistic sizes it times the Triton kernel, the same
op in eager torch (the fallback in ops.py, or torch's own fused op where torch
has one: scaled_dot_product_attention) and torch.compile of that same torch
code, and puts each time next to a ceiling measured in the same run on the
same GPU:

* bandwidth: a large device-to-device copy (read + write bytes / time);
* matmul rate: a large bf16 [8192 x 8192] @ [8192 x 8192].

Memory-bound rows count the *least* bytes the op must move (each input read
once, each output written once); attention counts matmul FLOPs (causal: half).
pct_of_ceiling is achieved / ceiling; vs_eager and vs_compile are speedups
(> 1: the kernel is faster). max_rel_err compares the kernel with the eager
output (the AdamW step: its update of the weights and both moments, from the
same state), a last sanity check of each kernel at full size.

On a machine without CUDA it says so and runs nothing: CPU timings of the
interpreter would measure nothing meaningful.
"""
import argparse
import csv
import datetime
import os
import time

import torch

from ..kernels import ops

FIELDS = ["kernel", "direction", "shape", "dtype", "ms_triton", "ms_eager", "ms_compile", "achieved",
          "unit", "ceiling", "pct_of_ceiling", "vs_eager", "vs_compile", "baseline", "max_rel_err"]


def _bench(fn):
    """Median milliseconds of fn (CUDA events, L2 flushed between runs by do_bench)."""
    if not torch.cuda.is_available():  # --smoke off the GPU: a plain clock, numbers meaningless
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_ceilings(device, smoke=False):
    n, k = (1 << 16, 256) if smoke else (1 << 29, 8192)  # a 1 GiB copy, an 8192^3 matmul
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    a = torch.randn(k, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(k, k, dtype=torch.bfloat16, device=device)
    mm_ms = _bench(lambda: a @ b)
    return {"GB/s": 2 * src.nbytes / copy_ms / 1e6, "TFLOP/s": 2 * k ** 3 / mm_ms / 1e9}


def _inputs(*shapes, dtype, device, grad=False):
    return [torch.randn(s, dtype=dtype, device=device).requires_grad_(grad) for s in shapes]


NOTHING_TO_MEASURE = (
    "minitron.bench kernels: no CUDA GPU here (or TRITON_INTERPRET=1), so there is nothing "
    "meaningful to measure: CPU timings of interpreted kernels say nothing about GPU speed. "
    "Nothing was run.")

SIZES = {  # Llama-3-8B-like: hidden 4096, ffn 14336, vocab 128256, 8192 tokens a step
    "attention": [(2, 4096, 32, 8, 128), (4, 2048, 16, 16, 64)],  # b, s, hq, hkv, d
    "norm": [(8192, 4096), (8192, 8192)],
    "swiglu": (8192, 14336), "bias_gelu": (8192, 16384), "softmax": (4, 32, 1024),
    "cross_entropy": (8192, 128256), "adamw": 1 << 28,
}
SMOKE = {  # --smoke: tiny sizes that check the script itself, anywhere (even the interpreter)
    "attention": [(1, 32, 2, 1, 16)], "norm": [(16, 48)], "swiglu": (16, 48), "bias_gelu": (16, 48),
    "softmax": (1, 1, 16), "cross_entropy": (8, 300), "adamw": 1024,
}


def cases(device, quick, sizes):
    """(kernel, shape text, dtype, op, inputs, fwd bytes or flops, bwd ditto, unit, eager op, baseline)"""
    bf16 = torch.bfloat16
    es = 2
    out = []
    # flash attention: causal; the first size is GQA 32 query heads on 8 kv heads, as in Llama-3-8B
    for b, s, hq, hkv, d in sizes["attention"][:1 if quick else None]:
        q, k, v = _inputs((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), dtype=bf16, device=device, grad=True)
        flops = 4 * b * hq * s * s * d / 2
        sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, enable_gqa=True)
        out.append(("flash_attention", f"b{b} s{s} hq{hq} hkv{hkv} d{d} causal", bf16,
                    lambda q, k, v: ops.flash_attention(q, k, v, causal=True), [q, k, v],
                    flops, 2.5 * flops, "TFLOP/s", sdpa, "torch SDPA"))
    for M, N in sizes["norm"][:1 if quick else None]:
        x, w, bias = _inputs((M, N), (N,), (N,), dtype=bf16, device=device, grad=True)
        out.append(("rms_norm", f"{M}x{N}", bf16, ops.rms_norm, [x, w],
                    2 * M * N * es, 3 * M * N * es, "GB/s", None, "ops fallback"))
        out.append(("layer_norm", f"{M}x{N}", bf16, ops.layer_norm, [x, w, bias],
                    2 * M * N * es, 3 * M * N * es, "GB/s", None, "ops fallback"))
    M, F = sizes["swiglu"]
    g, u = _inputs((M, F), (M, F), dtype=bf16, device=device, grad=True)
    out.append(("swiglu", f"{M}x{F}", bf16, ops.swiglu, [g, u], 3 * M * F * es, 5 * M * F * es,
                "GB/s", None, "ops fallback"))
    M, F = sizes["bias_gelu"]
    x, bias = _inputs((M, F), (F,), dtype=bf16, device=device, grad=True)
    for approx in ("none",) if quick else ("none", "tanh"):
        out.append(("bias_gelu", f"{M}x{F} {approx}", bf16,
                    lambda x, b, a=approx: ops.bias_gelu(x, b, a), [x, bias],
                    2 * M * F * es, 3 * M * F * es, "GB/s", None, "ops fallback"))
    b, h, s = sizes["softmax"]
    (sc,) = _inputs((b, h, s, s), dtype=bf16, device=device, grad=True)
    out.append(("scaled_masked_softmax", f"{b}x{h}x{s}x{s} causal", bf16,
                lambda t: ops.scaled_masked_softmax(t, 0.088, True), [sc],
                1.5 * sc.numel() * es, 3 * sc.numel() * es, "GB/s", None, "ops fallback"))
    N, V = sizes["cross_entropy"]
    (logits,) = _inputs((N, V), dtype=bf16, device=device, grad=True)
    targets = torch.randint(0, V, (N,), device=device)
    out.append(("cross_entropy", f"{N}x{V}", bf16, lambda x: ops.cross_entropy(x, targets), [logits],
                N * V * es, 2 * N * V * es, "GB/s", None, "ops fallback (F.cross_entropy)"))
    return out


def adamw_case(device, n):
    """(step, its error against the fallback, bytes a step moves)."""
    p, m, v = (torch.randn(n, device=device) for _ in range(3))
    v.abs_()
    g = torch.randn(n, device=device, dtype=torch.bfloat16)
    model = torch.empty(n, device=device, dtype=torch.bfloat16)
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10, model_param=model)

    def step(state=(p, m, v)):
        ops.fused_adamw_step(state[0], g, state[1], state[2], **hp)
        return state

    def error():
        """One kernel step and one fallback step from the same state. The weights move by
        about lr, so their error is that of the update (new - old), at the update's scale."""
        kernel = step(tuple(t.clone() for t in (p, m, v)))
        with ops.use_triton(False):
            ref = step(tuple(t.clone() for t in (p, m, v)))
        return max(_rel_err(kernel[0] - p, ref[0] - p), _rel_err(kernel[1], ref[1]),
                   _rel_err(kernel[2], ref[2]))

    return step, error, n * (4 + 4 + 2 + 4 + 4 + 4 + 4 + 2)  # p r/w, g, m r/w, v r/w, model copy


def _rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _row(kernel, direction, shape, dtype, t, te, tc, amount, unit, ceilings, baseline, err):
    achieved = amount / t / (1e6 if unit == "GB/s" else 1e9)
    return {"kernel": kernel, "direction": direction, "shape": shape, "dtype": str(dtype).split(".")[-1],
            "ms_triton": round(t, 4), "ms_eager": round(te, 4),
            "ms_compile": "" if tc is None else round(tc, 4), "achieved": round(achieved, 1),
            "unit": unit, "ceiling": round(ceilings[unit], 1),
            "pct_of_ceiling": round(100 * achieved / ceilings[unit], 1),
            "vs_eager": round(te / t, 2), "vs_compile": "" if tc is None else round(tc / t, 2),
            "baseline": baseline, "max_rel_err": f"{err:.2e}"}


def run_case(case, ceilings, with_compile):
    kernel, shape, dtype, op, inputs, fwd_amount, bwd_amount, unit, eager_op, baseline = case
    rows = []
    with ops.use_triton(False):
        eager = eager_op or op
        compiled = torch.compile(eager, dynamic=False) if with_compile else None
        ref = eager(*inputs)
        te = _bench(lambda: eager(*inputs))
        tc = _bench(lambda: compiled(*inputs)) if compiled else None
    y = op(*inputs)
    t = _bench(lambda: op(*inputs))
    rows.append(_row(kernel, "fwd", shape, dtype, t, te, tc, fwd_amount, unit, ceilings, baseline,
                     _rel_err(y, ref)))

    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, dy, retain_graph=True)
    tb = _bench(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True))
    ref_grads = torch.autograd.grad(ref, inputs, dy, retain_graph=True)
    teb = _bench(lambda: torch.autograd.grad(ref, inputs, dy, retain_graph=True))
    tcb = None
    if compiled:
        with ops.use_triton(False):
            yc = compiled(*inputs)
        tcb = _bench(lambda: torch.autograd.grad(yc, inputs, dy, retain_graph=True))
    err = max(_rel_err(a, b) for a, b in zip(grads, ref_grads))
    rows.append(_row(kernel, "bwd", shape, dtype, tb, teb, tcb, bwd_amount, unit, ceilings, baseline, err))
    return rows


def run(args=None):
    """Entry point; args: None, a list of command-line strings, or an argparse.Namespace."""
    if not isinstance(args, argparse.Namespace):
        args = _parser().parse_args([] if args is None else list(args))
    smoke = args.smoke and ops.available()
    if not smoke and (not torch.cuda.is_available() or ops.interpreting()):
        print(NOTHING_TO_MEASURE)
        return 0
    start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    path = args.csv or os.path.join("bench", "results", "kernels_{}_{}.csv".format(
        "".join(c if c.isalnum() else "-" for c in gpu), datetime.date.today().isoformat()))
    sizes = SMOKE if smoke else SIZES
    ceilings = measure_ceilings(device, smoke)
    print(f"{gpu}: copy {ceilings['GB/s']:.0f} GB/s, bf16 matmul {ceilings['TFLOP/s']:.0f} TFLOP/s")
    rows = []
    todo = cases(device, args.quick, sizes)
    for case in todo:
        if args.only and case[0] not in args.only:
            continue
        elapsed = time.time() - start
        if elapsed > args.budget_s:
            print(f"skipped {case[0]} {case[1]}: time budget of {args.budget_s}s spent")
            continue
        with_compile = not args.no_compile and elapsed < 0.75 * args.budget_s
        rows += run_case(case, ceilings, with_compile)
        _print(rows[-2:])
        _free()
    del todo
    _free()
    if not args.only or "fused_adamw_step" in args.only:
        step, error, nbytes = adamw_case(device, sizes["adamw"])
        err = error()
        t = _bench(step)
        with ops.use_triton(False):
            te = _bench(step)
            tc = None
            if not args.no_compile and time.time() - start < 0.75 * args.budget_s:
                tc = _bench(torch.compile(step, dynamic=False))
        rows.append(_row("fused_adamw_step", "step", f"{sizes['adamw']} params, bf16 grads", torch.float32, t, te,
                         tc, nbytes, "GB/s", ceilings, "ops fallback (AdamW single-tensor ops)", err))
        _print(rows[-1:])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path} ({len(rows)} rows, {time.time() - start:.0f} s)")
    return 0


def _free():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _print(rows):
    for r in rows:
        print(f"{r['kernel']:>22} {r['direction']:>4} {r['shape']:>30} {r['ms_triton']:>9} ms "
              f"{r['achieved']:>8} {r['unit']:<7} {r['pct_of_ceiling']:>5}% of ceiling  "
              f"x{r['vs_eager']} vs eager  x{r['vs_compile'] or '-'} vs compile  err {r['max_rel_err']}")


def _parser():
    p = argparse.ArgumentParser(prog="python -m minitron.bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=None, help="output CSV (default bench/results/kernels_<gpu>_<date>.csv)")
    p.add_argument("--only", nargs="*", default=None, help="kernel names to run")
    p.add_argument("--quick", action="store_true", help="one size per kernel")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, any device: checks the script, measures nothing")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="stop starting new cases after this many seconds")
    return p

