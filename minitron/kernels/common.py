"""What ops.py and the kernel files share. A leaf: it imports neither, so neither imports the other.

fix_interpreter_bf16() mends two bfloat16 bugs of Triton's CPU interpreter, and
patch_language_once_per_launch() one of its costs, once, before the first interpreted kernel
runs (ops._triton_path calls both).

``POISON = True`` makes every buffer a kernel writes start out full of NaN, so an element a
kernel forgets to write shows up in the comparison instead of silently holding whatever the
allocator left there (tests/test_kernels.py turns it on).
"""
import os

import torch

POISON = False


def alloc(shape, dtype, device):
    """Every kernel output goes through here (see POISON)."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fix_interpreter_bf16():
    """Two bfloat16 bugs of the interpreter (seen in triton 3.9), fixed so that
    CPU runs do the arithmetic a GPU does. Only the interpreter is touched.

    * It stores bf16 as raw uint16 and tl.dot multiplies those integers: widen
      bf16 operands to fp32 first (a GPU bf16 dot multiplies exactly and
      accumulates in fp32, so this is the same arithmetic).
    * Its fp32 -> bf16 cast truncates; a GPU rounds to nearest even.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except Exception:
        return
    if getattr(InterpreterBuilder, "_minitron_fixed", False):
        return
    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype.scalar == tl.bfloat16:
            a = cast(self, a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = cast(self, b, tl.float32)
        return dot(self, a, b, d, *args, **kwargs)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.array(src.data, dtype=np.float32))  # a contiguous copy
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)

    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl
    InterpreterBuilder._minitron_fixed = True


def patch_language_once_per_launch():
    """The interpreter re-patches triton.language (inspect.getmembers over its modules) at every
    call of a @triton.jit function from inside a kernel: tl.sum and tl.max are such functions, so
    each program of a row kernel paid it twice (one softmax launch of 66 rows: 133 patches, 2
    with this mend; tests/test_kernels.py counts them). Within one launch nothing undoes those
    patches (a device call's are never undone, the launch's only at its end), so a second patch
    from the same module changes nothing: it is skipped. The kernels' arithmetic is untouched.
    (A kernel launch is the call made while no launch is running.)"""
    try:
        from triton.runtime import interpreter
        real, scope_type = interpreter._patch_lang, interpreter._LangPatchScope
    except Exception:
        return
    if getattr(interpreter, "_minitron_patched_once", False):
        return
    patched = set()      # the modules (their globals) patched in the running launch; empty: none

    def patch_lang(fn):
        key = id(fn.__globals__)
        if key in patched:                        # patched already in this launch
            return scope_type()                   # nothing to undo
        launch = not patched
        scope = real(fn)
        patched.add(key)
        if launch:                                # its scope's restore ends the launch
            restore = scope.restore

            def end_of_launch():
                patched.clear()
                restore()
            scope.restore = end_of_launch
        return scope

    interpreter._patch_lang, interpreter._minitron_patched_once = patch_lang, True


def global_softmax_stats(row_max, sumexp, target_logit, allreduce_max, allreduce_sum):
    """The two collectives of vocab-parallel cross entropy, shared by both paths.

    From each shard's (row max, sum of exp at that max, target logit or 0) to the global
    (M, log S, x_target - M), S = sum_j exp(x_j - M). All ranks agree on M first, so that
    the sums of exp can be rescaled to it and added; the target logits are added raw
    (one rank's value plus zeros: exact) and shifted by M only then."""
    global_max = row_max.clone()
    allreduce_max(global_max)
    stats = torch.stack([sumexp * torch.exp(row_max - global_max), target_logit])
    allreduce_sum(stats)
    return global_max, torch.log(stats[0]), stats[1] - global_max
