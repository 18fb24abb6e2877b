"""Reference state dict <-> one tensor-parallel rank's state dict, both ways, exactly.

Every parameter of ParallelGPT is described by one `Rule`: its name, the reference tensors
it is made of, and the dimension along which they are split (None: replicated).

  rank r's tensor = cat_k( chunk_r(reference part k, along dim) , along dim )

One part is a plain split (embedding rows, a Linear's output or input features); several
parts are a fused layout: attention.qkv = [q_r; k_r; v_r] and, for SwiGLU,
mlp.fc1 = [gate_r; up_r]. Gathering inverts it: all-gather along dim, cut each rank's block
back into its parts, and concatenate each part's pieces in rank order.

Rules for the blocks are built per layer (`layer_rules(i, ...)`), so a pipeline stage can later
ask for the rules of its own layer range only.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import comm
from ..grid import Grid
from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str                      # key in ParallelGPT's state dict
    parts: tuple[str, ...]         # keys in the reference GPT's state dict
    dim: int | None                # split dimension; None = replicated on every tp rank
    sizes: tuple[int, ...] = ()    # fused parts only: each part's full size along dim


def _linear(cfg: ModelConfig, name: str, parts: tuple[str, ...], dim: int,
            sizes: tuple[int, ...] = ()) -> list[Rule]:
    """A Linear's weight rule and, when cfg.bias, its bias rule: split with a column-parallel
    weight (dim 0), whole with a row-parallel one (dim 1: added once, after the sum)."""
    rules = [Rule(f"{name}.weight", tuple(f"{p}.weight" for p in parts), dim, sizes)]
    if cfg.bias:
        rules.append(Rule(f"{name}.bias", tuple(f"{p}.bias" for p in parts),
                          0 if dim == 0 else None, sizes))
    return rules


def _norm(cfg: ModelConfig, name: str) -> list[Rule]:
    keys = ("weight",) if cfg.norm == "rmsnorm" else ("weight", "bias")
    return [Rule(f"{name}.{k}", (f"{name}.{k}",), None) for k in keys]


def layer_rules(i: int, cfg: ModelConfig) -> list[Rule]:
    """The rules of block i (same index on both sides)."""
    pre = f"layers.{i}"
    att, mlp = f"{pre}.attention", f"{pre}.mlp"
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if cfg.activation == "swiglu":
        fc1 = _linear(cfg, f"{mlp}.fc1", (f"{mlp}.gate", f"{mlp}.fc1"), 0, (cfg.ffn, cfg.ffn))
    else:
        fc1 = _linear(cfg, f"{mlp}.fc1", (f"{mlp}.fc1",), 0)
    return [*_norm(cfg, f"{pre}.attn_norm"),
            *_linear(cfg, f"{att}.qkv", (f"{att}.q", f"{att}.k", f"{att}.v"), 0, (q, kv, kv)),
            *_linear(cfg, f"{att}.out", (f"{att}.out",), 1),
            *_norm(cfg, f"{pre}.mlp_norm"),
            *fc1,
            *_linear(cfg, f"{mlp}.fc2", (f"{mlp}.fc2",), 1)]


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every parameter of ParallelGPT, in a fixed order (gathering is collective)."""
    out = [Rule("embedding.word.weight", ("embedding.word.weight",), 0)]
    if cfg.position == "learned":
        out.append(Rule("embedding.position.weight", ("embedding.position.weight",), None))
    for i in range(cfg.n_layers):
        out += layer_rules(i, cfg)
    out += _norm(cfg, "final_norm")
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",), 0))
    return out


def shard_state_dict(full_sd: dict, cfg: ModelConfig, grid: Grid) -> dict:
    """This rank's ParallelGPT state dict cut from a reference GPT state dict (no communication)."""
    tp, r = grid.tp.size, grid.tp.rank
    local = {}
    for rule in rules(cfg):
        if rule.dim is None:
            local[rule.name] = full_sd[rule.parts[0]].clone()
        else:
            local[rule.name] = torch.cat([full_sd[p].chunk(tp, rule.dim)[r] for p in rule.parts],
                                         rule.dim).clone()
    return local


def gather_state_dict(local_sd: dict, cfg: ModelConfig, grid: Grid) -> dict:
    """The reference-layout state dict, assembled on every rank (one all-gather per split tensor).

    Works for any dict with ParallelGPT's keys: weights, or their gradients.
    """
    tp = grid.tp.size
    full = {}
    for rule in rules(cfg):
        t = local_sd[rule.name]
        if rule.dim is None:
            full[rule.parts[0]] = t.clone()
            continue
        blocks = comm.all_gather(t.contiguous(), grid.tp, dim=rule.dim).chunk(tp, rule.dim)
        sizes = [n // tp for n in rule.sizes] if rule.sizes else [t.shape[rule.dim]]
        pieces = [b.split(sizes, rule.dim) for b in blocks]          # [rank][part]
        for k, name in enumerate(rule.parts):
            full[name] = torch.cat([pieces[rank][k] for rank in range(tp)], rule.dim)
    return full


def grads_state_dict(model: torch.nn.Module) -> dict:
    """{name: grad} for every parameter that has one, keyed like the model's state dict."""
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
