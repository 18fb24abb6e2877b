"""The shape of a model the planner plans: minitron's ModelConfig, plus the mixture-of-experts
sizes of today's models that minitron's own model does not build, and named presets with their
sources.

  moe_ffn_hidden   each routed expert's FFN width (DeepSeekMoE's fine-grained experts are
                   narrower than a dense FFN); None: the model's ffn.
  shared_experts   experts every token visits beside its top-k routed ones (DeepSeekMoE,
                   Dai et al. 2024, §3.2), each of moe_ffn_hidden columns.

The estimators read them through expert_ffn() and shared_experts(), so a plain ModelConfig
(no such fields) plans as before.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Shape(ModelConfig):
    moe_ffn_hidden: int | None = None
    shared_experts: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.moe_ffn_hidden is not None and (type(self.moe_ffn_hidden) is not int or self.moe_ffn_hidden < 1):
            raise ValueError(f"moe_ffn_hidden must be a positive integer, got {self.moe_ffn_hidden!r}: "
                             "e.g. --moe-ffn-hidden 2048")
        if type(self.shared_experts) is not int or self.shared_experts < 0:
            raise ValueError(f"shared_experts must be an integer >= 0, got {self.shared_experts!r}: "
                             "e.g. --shared-experts 1")
        if (self.moe_ffn_hidden or self.shared_experts) and not self.n_experts:
            raise ValueError("--moe-ffn-hidden and --shared-experts describe experts: give --experts "
                             "(e.g. --experts 64 --topk 6) or drop them")


def expert_ffn(cfg: ModelConfig) -> int:
    return getattr(cfg, "moe_ffn_hidden", None) or cfg.ffn


def shared_experts(cfg: ModelConfig) -> int:
    return getattr(cfg, "shared_experts", 0)


def mlp_matrices(cfg: ModelConfig) -> int:
    """Weight matrices of one MLP: SwiGLU's gate, up and down; GeLU's fc1 and fc2."""
    return 3 if cfg.activation == "swiglu" else 2


# Today's models, as their papers and released configurations give them. Llama 3 (Dubey et al.
# 2024, "The Llama 3 Herd of Models", Table 3: layers, model dimension, FFN dimension, heads,
# 8 key/value heads, RoPE, SwiGLU, RMSNorm, 8192-token pre-training sequences, §3.4.1); the
# vocabulary 128256 is the released config.json's (the paper rounds it to 128K). Mixtral 8x7B
# (Jiang et al. 2024, "Mixtral of Experts", Table 1: dim 4096, 32 layers, 32 heads, 8 kv heads,
# hidden 14336, 8 experts, top 2, vocab 32000, context 32768).
_LLAMA = dict(vocab_size=128256, seq_len=8192, n_kv_heads=8, norm="rmsnorm", activation="swiglu",
              position="rope", bias=False, tie_embeddings=False)
MODERN = {
    "llama3-8b": Shape(hidden=4096, n_layers=32, n_heads=32, ffn_hidden=14336, **_LLAMA),
    "llama3-70b": Shape(hidden=8192, n_layers=80, n_heads=64, ffn_hidden=28672, **_LLAMA),
    "llama3-405b": Shape(hidden=16384, n_layers=126, n_heads=128, ffn_hidden=53248, **_LLAMA),
    "mixtral-8x7b": Shape(hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                          vocab_size=32000, seq_len=32768, norm="rmsnorm", activation="swiglu",
                          position="rope", bias=False, n_experts=8, topk=2),
}
