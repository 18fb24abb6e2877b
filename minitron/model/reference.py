"""The single-device GPT: the ground truth every parallel version is compared against.

Pre-norm blocks: x + Attention(Norm(x)), then x + MLP(Norm(x)). Activations are
[batch, sequence, hidden]. Nothing here knows about ranks; the parallel model mirrors
these module names so a state dict can be sharded from this one and gathered back.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..moe.experts import enable_fp8_experts
from ..moe.reference import MoE
from ..tensor_parallel.fp8_linear import FP8State
from ..tensor_parallel.random import DropoutRNG
from ..config import ModelConfig


def make_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    size = size or cfg.hidden
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(size, eps=cfg.norm_eps)
    return nn.LayerNorm(size, eps=cfg.norm_eps)


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of x [b, heads, s, d] by position-dependent angles."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]       # [s, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_core(q, k, v, cfg: ModelConfig, rng: DropoutRNG, training: bool,
                   head_index=None, full_heads: int | None = None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v for q [b, hq, s, d], k/v [b, hkv, s, d].

    `head_index`/`full_heads` let a tensor-parallel rank draw the reference's dropout mask
    and keep only its own heads.
    """
    group = q.shape[1] // k.shape[1]            # query heads per key/value head (GQA)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    b = q.shape[0]
    full = (b, full_heads or q.shape[1], s, s)
    idx = None if head_index is None else (slice(None), head_index)
    probs = rng.dropout(probs, cfg.dropout, training, index=idx, full_shape=full)
    return probs @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.n_heads * hd, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=cfg.bias)
        self.out = nn.Linear(cfg.n_heads * hd, cfg.hidden, bias=cfg.bias)
        self.fp8 = None     # {"qkv": FP8State, "out": FP8State} once GPT.enable_fp8 runs

    def forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        if self.fp8:      # one FP8 GEMM for q, k and v, as the split's fused qkv casts them
            q, k, v = one_gemm(x, (self.q, self.k, self.v), self.fp8["qkv"]).split(
                [m.out_features for m in (self.q, self.k, self.v)], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, s, -1, hd).transpose(1, 2)   # [b, heads, s, hd]
        k = k.view(b, s, -1, hd).transpose(1, 2)
        v = v.view(b, s, -1, hd).transpose(1, 2)
        if self.cfg.position == "rope":
            pos = torch.arange(s, device=x.device)
            q, k = rotary(q, pos, self.cfg.rope_base), rotary(k, pos, self.cfg.rope_base)
        y = attention_core(q, k, v, self.cfg, rng, self.training)
        return one_gemm(y.transpose(1, 2).reshape(b, s, -1), (self.out,), self.fp8 and self.fp8["out"])


def one_gemm(x: torch.Tensor, linears, state) -> torch.Tensor:
    """x through `linears` side by side (their outputs concatenated), as one GEMM: in FP8 when a
    state is given (one scale for the fused weight: the split's casting point), else each alone."""
    if state is None:
        return torch.cat([m(x) for m in linears], dim=-1) if len(linears) > 1 else linears[0](x)
    weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
    bias = None if linears[0].bias is None else \
        (torch.cat([m.bias for m in linears]) if len(linears) > 1 else linears[0].bias)
    return state.linear(x, weight, bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.activation == "swiglu":
            self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)   # the "up" projection
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
        self.fp8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.fp8 or {}
        if self.cfg.activation == "swiglu":    # [gate; up] in one GEMM under FP8, as the split's fc1
            gate, up = one_gemm(x, (self.gate, self.fc1), state.get("fc1")).chunk(2, dim=-1) \
                if state else (self.gate(x), self.fc1(x))
            return one_gemm(F.silu(gate) * up, (self.fc2,), state.get("fc2"))
        return one_gemm(F.gelu(one_gemm(x, (self.fc1,), state.get("fc1"))), (self.fc2,), state.get("fc2"))


class Block(nn.Module):
    """`moe`: the MLP is a mixture of experts (minitron/moe/reference.py), same interface."""

    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        p, train = self.cfg.dropout, self.training
        x = x + rng.dropout(self.attention(self.attn_norm(x), rng), p, train)
        return x + rng.dropout(self.mlp(self.mlp_norm(x)), p, train)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        if cfg.position == "learned":
            self.position = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word(tokens)
        if hasattr(self, "position"):
            x = x + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        return x


class GPT(nn.Module):
    """forward(tokens) -> logits [b, s, vocab]; forward(tokens, targets) -> (logits, loss)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.n_layers))
        self.final_norm = make_norm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.rng = DropoutRNG(seed)
        init_weights(self, cfg, seed)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than "
                             f"ModelConfig.seq_len={self.cfg.seq_len}")
        self.rng.at_layer(-1)
        return self.rng.dropout(self.embedding(tokens), self.cfg.dropout, self.training)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            self.rng.at_layer(i)          # masks are keyed by layer (tensor_parallel/random.py)
            x = layer(x, self.rng)
        return self.final_norm(x)

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def enable_fp8(self, recipe) -> None:
        """Every GEMM of the blocks in FP8 (tensor_parallel/fp8_linear.py), at ParallelGPT's
        casting points: q, k and v as one fused GEMM, [gate; up] as one, then attention.out and
        fc2; one FP8State each, one scale per fused weight. The LM head stays 16-bit. An MoE
        layer's experts: one ExpertState per expert and GEMM (moe/experts.py's enable_fp8_experts)."""
        for layer in self.layers:
            layer.attention.fp8 = {"qkv": FP8State(recipe), "out": FP8State(recipe)}
            if isinstance(layer.mlp, MoE):
                enable_fp8_experts(layer.mlp, recipe)
            else:
                layer.mlp.fp8 = {"fc1": FP8State(recipe), "fc2": FP8State(recipe)}

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def moe_loss(self) -> torch.Tensor | float:
        """The routers' auxiliary losses of the last forward (0.0 without experts)."""
        return sum((m.aux_loss for m in self.moe_layers()), 0.0)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """With experts, the loss includes their auxiliary losses (moe_loss)."""
        logits = self.run_layers(self.embed(tokens)) @ self.output_weight().t()
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss + self.moe_loss()


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Deterministic init from `seed`: normal(0, init_std) matrices, GPT-2's scaled residual
    projections, zero biases, unit norm weights."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                std = cfg.init_std
                if name.endswith(("attention.out.weight", "mlp.fc2.weight", "experts.fc2.weight")):
                    std /= math.sqrt(2 * cfg.n_layers)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
