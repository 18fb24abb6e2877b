"""AdamW on CPU through torch's own fused kernel, each element rounded the same wherever a shard
was cut (kernels/ops.fused_adamw_step's CPU path; tests/test_adamw_cpu.py).
"""
import torch

# torch's fused CPU AdamW (ATen's FusedAdamKernel.cpp) makes one pass instead of the eager
# path's six (3.3x faster on a 4M-element shard), but it does not round every element alike:
# each 64-byte unit of a tensor goes through a vector loop (its lerp a fused multiply-add),
# the tensor's last numel % 16 elements through a scalar loop that rounds differently. Which
# elements come last depends on where a shard was cut, and ZeRO cuts at different places on
# different grids (a tied embedding's two copies even within one run), so the same weight would
# end up a bit apart. Hence every element takes the vector loop: the body (a multiple of 16
# elements, so every unit the kernel hands a thread is whole) in place, the tail through a
# zero-padded 16-element scratch. Lanes are independent, so an element's result then depends
# on its own values only, never on its offset.
_FUSED_UNIT = 16            # 64 bytes of float32: the kernel's work unit, >= its vector width


def fused_cpu_applies(param, grad, exp_avg, exp_avg_sq) -> bool:
    tensors = (param, grad, exp_avg, exp_avg_sq)
    return (hasattr(torch, "_fused_adamw_") and param.device.type == "cpu"
            and all(t.dtype == torch.float32 for t in (param, exp_avg, exp_avg_sq))
            and grad.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(t.is_contiguous() for t in tensors))


def fused_cpu_adamw(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step):
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    n = flat[0].numel()
    body = n - n % _FUSED_UNIT
    lists = [[t[:body]] if body else [] for t in flat]
    tail = None
    if body < n:
        tail = [torch.zeros(_FUSED_UNIT) for _ in flat]
        for scratch, t in zip(tail, flat):
            scratch[:n - body].copy_(t[body:])
        for lst, scratch in zip(lists, tail):
            lst.append(scratch)
    steps = [torch.tensor(float(step))] * len(lists[0])
    torch._fused_adamw_(*lists, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if tail is not None:
        for scratch, t in zip(tail, flat):
            if t is not flat[1]:                      # the gradient is only read
                t[body:].copy_(scratch[:n - body])
