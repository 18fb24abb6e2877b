"""Public entry points of the fused kernels, each with a pure-torch twin.

Every op here decides once per call which path to take:

* the Triton path when Triton is importable and the input lives on a CUDA
  device, or when the Triton interpreter is on (``TRITON_INTERPRET=1`` set
  *before* triton is first imported), which runs the very same kernels on CPU
  tensors, slowly, for testing;
* otherwise the pure-torch fallback, written to be obviously correct.

``use_triton(False)`` forces the fallback (as a plain call, or as a ``with``
block that restores the previous setting on exit), so a benchmark or a test
can compare the two paths on the same input.

``common.POISON = True`` makes every buffer a kernel writes start out full of NaN
(common.py: what ops.py and the kernel files share, imported by both, importing neither).

Kernel modules import triton at their top; they are imported here lazily, so
``import minitron.kernels`` works on a machine with no triton and no GPU.
"""
import functools
import math

import torch
import torch.nn.functional as F

from .adamw_cpu import fused_cpu_adamw, fused_cpu_applies
from .common import fix_interpreter_bf16, global_softmax_stats, interpreting, patch_language_once_per_launch

_ENABLED = True


@functools.lru_cache(maxsize=None)
def _triton_importable():
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def available():
    """True when the Triton kernels can run here (a GPU, or the interpreter).

    device_count() asks NVML: torch.cuda.is_available() would initialise CUDA here, and
    minitron.launch's ranks, forked from this process, could then not use their GPUs."""
    return _triton_importable() and (torch.cuda.device_count() > 0 or interpreting())


class use_triton:
    """``use_triton(False)`` forces the torch fallback from now on;
    ``with use_triton(False): ...`` does so only inside the block."""

    def __init__(self, flag=True):
        global _ENABLED
        self.previous, _ENABLED = _ENABLED, bool(flag)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _ENABLED
        _ENABLED = self.previous


def _wide(t):
    """The fallbacks compute in fp32, or in float64 when given float64 (references)."""
    return t if t.dtype == torch.float64 else t.float()


def _triton_path(t):
    if not (_ENABLED and (t.is_cuda or interpreting()) and _triton_importable()):
        return False
    if interpreting():
        fix_interpreter_bf16()  # once; a no-op after
        patch_language_once_per_launch()
    return True


# --------------------------------------------------------------------------- norms
def rms_norm(x, weight, eps=1e-5):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32, returned in x.dtype."""
    if _triton_path(x):
        from .rmsnorm import RMSNormFn
        return RMSNormFn.apply(x, weight, eps)
    xf = _wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _wide(weight)).to(x.dtype)


def layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim, computed in fp32, returned in x.dtype."""
    if _triton_path(x):
        from .layernorm import LayerNormFn
        return LayerNormFn.apply(x, weight, bias, eps)
    y = F.layer_norm(_wide(x), x.shape[-1:], _wide(weight), _wide(bias), eps)
    return y.to(x.dtype)


# --------------------------------------------------------------------------- softmax
def scaled_masked_softmax(scores, scale, causal):
    """softmax(scale * scores) over the last dim of [b, h, sq, sk]; with causal,
    query i sees keys j <= i (both from 0). Computed in fp32, returned in scores.dtype."""
    if _triton_path(scores):
        from .softmax import ScaledMaskedSoftmaxFn
        return ScaledMaskedSoftmaxFn.apply(scores, scale, causal)
    s = _wide(scores) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1).to(scores.dtype)


# --------------------------------------------------------------------------- attention
def flash_attention(q, k, v, causal=True, scale=None, return_lse=False):
    """softmax(q k^T * scale) v for q [b, hq, sq, d], k/v [b, hkv, sk, d].

    Grouped-query attention: query head i reads kv head i // (hq // hkv).
    Causal means query i sees keys j <= i, both indexed from 0 (top-left
    aligned; when sq != sk nothing is shifted). scale defaults to d ** -0.5.
    With return_lse=True also returns lse = logsumexp_j(q.k_j * scale) in
    natural log, fp32, [b, hq, sq]: what ring attention needs to merge partials.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _triton_path(q):
        from .flash_attention import FlashAttentionFn
        out, lse = FlashAttentionFn.apply(q, k, v, causal, scale)
        return (out, lse) if return_lse else out
    group = q.shape[1] // k.shape[1]
    kf = _wide(k).repeat_interleave(group, dim=1)
    vf = _wide(v).repeat_interleave(group, dim=1)
    s = _wide(q) @ kf.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.exp(s - lse[..., None]) @ vf).to(q.dtype)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- cross entropy
# Large logits: with x ~ 1e4 a float32 lse = max + log(sum) is off by up to half an ulp of 1e4
# (5e-4), and so would be lse - x_target and exp(x - lse). So lse is never formed: every path
# keeps the max M and works with x - M (computed once, at the scale of the differences) and
# log S, S = sum_j exp(x_j - M): loss = log S - (x_target - M), dloss/dx_j = exp(x_j - M - log S).
def check_targets(targets, vocab_size, ignore_index=-100):
    """ValueError unless every target is a class in [0, vocab_size) or ignore_index."""
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"targets must be integer class ids, got {targets.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bad.any():
        first = targets[bad][0].item()
        raise ValueError(f"targets must be in [0, {vocab_size}) or ignore_index ({ignore_index}); "
                         f"got {first} ({int(bad.sum())} out of range): fix the data or the vocabulary size")


def cross_entropy(logits, targets, ignore_index=-100):
    """Mean over non-ignored tokens of -log softmax(logits)[target], like F.cross_entropy."""
    logits2 = logits.reshape(-1, logits.shape[-1])
    targets1 = targets.reshape(-1)
    check_targets(targets1, logits2.shape[-1], ignore_index)
    if _triton_path(logits):
        from .cross_entropy import CrossEntropyFn
        losses = CrossEntropyFn.apply(logits2, targets1, 0, None, None, ignore_index)
        return losses.sum() / (targets1 != ignore_index).sum()
    return F.cross_entropy(_wide(logits2), targets1, ignore_index=ignore_index)


def vocab_parallel_ce_partials(logits_shard, targets, vocab_start, ignore_index=-100):
    """Per-row statistics of one vocab shard [N, Vs] holding columns
    [vocab_start, vocab_start + Vs): (row_max, sum_j exp(x_j - row_max),
    target_logit or 0 when the target is not in this shard). All fp32 [N]."""
    if _triton_path(logits_shard):
        from .cross_entropy import ce_partials
        return ce_partials(logits_shard, targets, vocab_start, ignore_index)
    x = _wide(logits_shard)
    row_max = x.max(-1).values
    sumexp = torch.exp(x - row_max[:, None]).sum(-1)
    local = targets - vocab_start
    mine = (local >= 0) & (local < x.shape[-1]) & (targets != ignore_index)
    picked = x.gather(1, local.clamp(0, x.shape[-1] - 1)[:, None])[:, 0]
    return row_max, sumexp, torch.where(mine, picked, torch.zeros_like(picked))


def merge_vocab_parallel_partials(partials, targets=None, ignore_index=-100):
    """Pure-torch merge of the partials of all shards (a list of triples) into
    per-token losses: what the all-reduces compute across ranks."""
    maxes = torch.stack([p[0] for p in partials])
    global_max = maxes.max(0).values
    sumexp = sum(p[1] * torch.exp(p[0] - global_max) for p in partials)
    target_logit = sum(p[2] for p in partials)   # one shard's value plus zeros: exact
    loss = torch.log(sumexp) - (target_logit - global_max)
    if targets is not None:
        loss = torch.where(targets == ignore_index, torch.zeros_like(loss), loss)
    return loss


def vocab_parallel_cross_entropy(logits_shard, targets, vocab_start,
                                 group_allreduce_max, group_allreduce_sum, ignore_index=-100):
    """Per-token losses [N] when each tensor-parallel rank holds a vocab shard.

    group_allreduce_max(t) / group_allreduce_sum(t) all-reduce t in place over
    the tensor-parallel group (identity lambdas on one rank with the full
    vocab). Ignored tokens get loss 0 and no gradient. Targets are not checked
    here (a shard does not know the vocabulary's size): callers use check_targets."""
    if _triton_path(logits_shard):
        from .cross_entropy import CrossEntropyFn
        return CrossEntropyFn.apply(logits_shard, targets, vocab_start,
                                    group_allreduce_max, group_allreduce_sum, ignore_index)
    return _VocabParallelCETorch.apply(logits_shard, targets, vocab_start,
                                       group_allreduce_max, group_allreduce_sum, ignore_index)


class _VocabParallelCETorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, allreduce_max, allreduce_sum, ignore_index):
        with use_triton(False):
            m, s, t = vocab_parallel_ce_partials(logits, targets, vocab_start, ignore_index)
        global_max, log_sum, target_shifted = global_softmax_stats(m, s, t, allreduce_max, allreduce_sum)
        ignored = targets == ignore_index
        ctx.save_for_backward(logits, targets, global_max, log_sum, ignored)
        ctx.vocab_start = vocab_start
        return torch.where(ignored, torch.zeros_like(log_sum), log_sum - target_shifted)

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, global_max, log_sum, ignored = ctx.saved_tensors
        grad = torch.exp(_wide(logits) - global_max[:, None] - log_sum[:, None])
        local = targets - ctx.vocab_start
        mine = (local >= 0) & (local < logits.shape[-1]) & ~ignored
        rows = torch.nonzero(mine)[:, 0]
        grad[rows, local[rows]] -= 1.0
        grad *= torch.where(ignored, torch.zeros_like(dloss), dloss)[:, None]
        return grad.to(logits.dtype), None, None, None, None, None


# --------------------------------------------------------------------------- MLP activations
def swiglu(gate, up):
    """silu(gate) * up, computed in fp32, returned in gate.dtype."""
    if _triton_path(gate):
        from .gated_mlp import SwiGLUFn
        return SwiGLUFn.apply(gate, up)
    return (F.silu(_wide(gate)) * _wide(up)).to(gate.dtype)


def bias_gelu(x, bias, approximate="none"):
    """gelu(x + bias); approximate='none' is the exact erf GeLU (torch's
    default), 'tanh' the tanh approximation. Returned in x.dtype."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if _triton_path(x):
        from .gated_mlp import BiasGeLUFn
        return BiasGeLUFn.apply(x, bias, approximate)
    return F.gelu(_wide(x) + _wide(bias), approximate=approximate).to(x.dtype)


# --------------------------------------------------------------------------- optimizer
@torch.no_grad()
def fused_adamw_step(param_fp32, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps,
                     weight_decay, step, model_param=None):
    """One AdamW step in place, as torch.optim.AdamW(fused=False) does it:
    decoupled decay p *= 1 - lr*wd, then the bias-corrected Adam update.
    step counts from 1. grad may be any float dtype; optionally writes the
    updated parameter, cast, into model_param (the low-precision model copy).

    Three paths: the Triton kernel (GPUs, the interpreter); on CPU fp32, torch's own
    fused AdamW kernel, every element through its vector loop (adamw_cpu.py);
    otherwise (float64 references, other devices) torch's ops one by one."""
    bc1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    if _triton_path(param_fp32):
        from .adamw import adamw_step
        adamw_step(param_fp32, grad, exp_avg, exp_avg_sq, model_param, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, weight_decay=weight_decay, step_size=lr / bc1,
                   bc2_sqrt=bc2_sqrt)
        return
    if fused_cpu_applies(param_fp32, grad, exp_avg, exp_avg_sq):
        fused_cpu_adamw(param_fp32, grad.float(), exp_avg, exp_avg_sq, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        if model_param is not None:
            model_param.copy_(param_fp32)
        return
    g = _wide(grad)
    param_fp32.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps)   # one temporary, as torch.optim.AdamW
    param_fp32.addcdiv_(exp_avg, denom, value=-(lr / bc1))
    if model_param is not None:
        model_param.copy_(param_fp32)
