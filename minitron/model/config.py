"""The shape of a GPT, shared by the single-device reference and every parallel version."""
from __future__ import annotations

import dataclasses

CHOICES = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "swiglu"),
           "position": ("learned", "rope"), "dropout_rng": ("exact", "per_rank")}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    seq_len: int = 32             # longest sequence (learned positions have this many rows)
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention when < n_heads; None: = n_heads
    ffn_hidden: int | None = None  # None: 4 * hidden
    norm: str = "layernorm"
    activation: str = "gelu"
    position: str = "learned"
    dropout: float = 0.0          # embedding, attention-probability and residual dropout
    # How a ParallelGPT rank draws its dropout masks (see tensor_parallel/random.py):
    # "exact": the full mask, keep this rank's slice; equal to the reference's, element for
    #          element (what the verifier checks), at tp times the mask memory;
    # "per_rank": Megatron's seeding, seed + 2718 + tp_rank in tensor-parallel regions and
    #          seed in replicated ones; only the local mask is drawn, but with dropout > 0
    #          the masks are not the reference's. The single-device GPT always draws exact.
    dropout_rng: str = "exact"
    tie_embeddings: bool = False
    bias: bool = True             # biases on the linear layers (norms always have theirs)
    norm_eps: float = 1e-5
    init_std: float = 0.02
    rope_base: float = 10000.0
    use_kernels: bool = False     # fused Triton kernels where minitron.kernels provides them

    def __post_init__(self):
        for field in ("vocab_size", "seq_len", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            value = getattr(self, field)
            optional = field in ("n_kv_heads", "ffn_hidden")   # None: the default described above
            if not (optional and value is None) and (type(value) is not int or value < 1):
                raise ValueError(f"ModelConfig.{field} must be a positive integer"
                                 f"{' or None' if optional else ''}, got {value!r}")
        for field, allowed in CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: choose one of {allowed}")
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden
