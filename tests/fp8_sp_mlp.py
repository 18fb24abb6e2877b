"""The FP8 Column -> GeLU -> Row pair under SP that the overlapped-ring tests run both ways
(plain SP and --tp-comm-overlap): the same weights, inputs and output gradients on every call."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minitron.grid import ParallelConfig, build_grid
from minitron.runtime import comm
from minitron.tensor_parallel.fp8 import FP8Recipe
from minitron.tensor_parallel.fp8_linear import enable_fp8
from minitron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

B, S, H, FFN = 2, 8, 16, 32          # tp 2: ring chunks of S / 2 = 4 tokens per sequence


def fp8_sp_mlp(overlapped: bool, recipe: FP8Recipe):
    """(mlp, tp group, generator): one world-wide tp group, bf16 weights cut from full ones."""
    group = build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=True)).tp
    gen = torch.Generator().manual_seed(0)
    W1, W2 = torch.randn(FFN, H, generator=gen), torch.randn(H, FFN, generator=gen)
    mlp = nn.ModuleDict({
        "fc1": ColumnParallelLinear(H, FFN, group, sequence_parallel=True, comm_overlap=overlapped),
        "fc2": RowParallelLinear(FFN, H, group, sequence_parallel=True, comm_overlap=overlapped)})
    with torch.no_grad():
        mlp["fc1"].weight.copy_(W1.chunk(group.size, 0)[group.rank])
        mlp["fc2"].weight.copy_(W2.chunk(group.size, 1)[group.rank])
    mlp = mlp.to(torch.bfloat16)
    enable_fp8(mlp, recipe, group)
    return mlp, group, gen


def steps(mlp, group, gen, n: int = 2, outlier: bool = False) -> list[dict]:
    """n steps: each one's output, dL/dx and the gathered weight gradients. outlier: feature 3
    of the input 50x the rest (so a scale per block differs from one per tensor)."""
    out = []
    for _ in range(n):
        x = torch.randn(B, S, H, generator=gen)
        if outlier:
            x[:, :, 3] *= 50
        x = x.chunk(group.size, 1)[group.rank].bfloat16().requires_grad_()
        g = torch.randn(B, S, H, generator=gen).chunk(group.size, 1)[group.rank].bfloat16()
        y = mlp["fc2"](F.gelu(mlp["fc1"](x)))
        (y.float() * g.float()).sum().backward()
        out.append({"y": y.detach(), "dx": x.grad,
                    "dW1": comm.all_gather(mlp["fc1"].weight.grad, group, 0),
                    "dW2": comm.all_gather(mlp["fc2"].weight.grad, group, 1)})
        for p in mlp.parameters():
            p.grad = None
    return out
