"""The shape of a GPT, shared by the single-device reference and every parallel version."""
from __future__ import annotations

import dataclasses
import math

CHOICES = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "swiglu"),
           "position": ("learned", "rope"), "dropout_rng": ("exact", "per_rank"),
           "recompute": ("none", "selective", "full")}


def check_number(flag: str, value, what: str, example, *, minimum: float = 0.0,
                 allow_minimum: bool = False, integer: bool = False) -> None:
    """ValueError unless `value` is a finite number above `minimum` (or equal, with
    allow_minimum): the one rule for a hyperparameter flag, shared by the CLIs. The message
    names the flag and a value that works: `--lr nan: the learning rate must be a finite
    number > 0, e.g. --lr 3e-4`. NaN fails every comparison, so `value < 0` alone lets it in."""
    kind = "an integer" if integer else "a finite number"
    bound = f"{'>=' if allow_minimum else '>'} {minimum:g}"
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) \
        and math.isfinite(value) and (value >= minimum if allow_minimum else value > minimum)
    if not ok:
        raise ValueError(f"{flag} {value}: {what} must be {kind} {bound}, e.g. {flag} {example}")


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
    # Activation recomputation in ParallelGPT (minitron/recompute.py): "full" keeps only each
    # layer's input and reruns the layer in backward; "selective" reruns only the attention
    # core (Korthikanti et al. 2022). Numerics unchanged; the reference GPT ignores it.
    recompute: str = "none"
    # Mixture of experts (minitron/moe/): n_experts > 0 makes the MLP of every `moe_every`-th
    # layer (layers 0, moe_every, 2*moe_every, ..., as Megatron's moe_layer_freq) a router
    # choosing `topk` of n_experts expert MLPs (each of ffn columns) per token.
    n_experts: int = 0
    topk: int = 2
    moe_every: int = 1
    capacity_factor: float | None = None  # None: dropless; else each expert takes at most
    #                                       ceil(factor * seq * topk / n_experts) tokens per sequence
    router_pre_softmax: bool = False      # softmax over all experts, then top-k (Switch); False:
    #                                       top-k of the logits, softmax over those k (Megatron's default)
    aux_loss_coeff: float = 0.01          # Switch load-balancing loss, added to the loss
    z_loss_coeff: float = 0.0             # router z-loss (ST-MoE): mean logsumexp(logits)^2
    expert_bias: bool = False             # aux-loss-free balancing (DeepSeek-V3): a per-expert
    #                                       bias added to the scores for choosing only

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
        self._validate_moe()

    def _validate_moe(self) -> None:
        if type(self.n_experts) is not int or self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be an integer >= 0 (0: dense MLPs), "
                             f"got {self.n_experts!r}")
        if not self.n_experts:
            return
        if type(self.topk) is not int or not 1 <= self.topk <= self.n_experts:
            raise ValueError(f"ModelConfig.topk={self.topk!r}: each token picks topk experts of "
                             f"n_experts={self.n_experts}; choose 1 <= topk <= {self.n_experts}")
        if type(self.moe_every) is not int or not 1 <= self.moe_every <= self.n_layers:
            raise ValueError(f"ModelConfig.moe_every={self.moe_every!r}: choose 1 (every layer) "
                             f"to n_layers={self.n_layers} (layer 0 only)")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise ValueError(f"ModelConfig.capacity_factor={self.capacity_factor!r}: use a "
                             "finite positive number, or None for dropless routing")
        for field in ("aux_loss_coeff", "z_loss_coeff"):
            if not 0 <= getattr(self, field) < math.inf:
                raise ValueError(f"ModelConfig.{field} must be finite and >= 0, got {getattr(self, field)!r}")
        if self.recompute == "full":
            raise ValueError("recompute='full' reruns each block under a checkpoint whose first "
                             "forward keeps no graph, so the routers' auxiliary losses would get "
                             "no gradient: use recompute='selective' or 'none' with experts")
        if self.topk == 1 and not self.router_pre_softmax and self.aux_loss_coeff == 0 \
                and self.z_loss_coeff == 0:
            raise ValueError("topk=1 with router_pre_softmax=False gives every token the gate "
                             "softmax([x]) = 1, so the router never learns: set "
                             "router_pre_softmax=True, or an aux/z loss coefficient")

    def is_moe_layer(self, i: int) -> bool:
        """Does layer i hold a mixture of experts (Megatron's moe_layer_freq pattern)?"""
        return self.n_experts > 0 and i % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden
