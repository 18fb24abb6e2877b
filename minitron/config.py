"""The shape of a GPT, shared by the single-device reference and every parallel version.

Every refusal here and in minitron.grid is a ConfigError: it names the settings (fields) that
clash and settings that would work, as `field=value` from Python and as `--flag value` from a
command line (ConfigError.as_flags, with the command's own flag names).
"""
from __future__ import annotations

import dataclasses
import math

CHOICES = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "swiglu"),
           "position": ("learned", "rope"), "dropout_rng": ("exact", "per_rank"),
           "recompute": ("none", "selective", "full"), "aux_loss_scope": ("global", "replica")}


class ConfigError(ValueError):
    """A setting that cannot work, and settings that would.

    `template` names settings as {field}; `values` holds their values; each of `fixes` is one
    alternative that works ({field: value, ...}). str(e) reads `field=value` (the Python API,
    `note` appended); as_flags(flags) reads `--flag value` for a command line, flags mapping a
    field to its flag (a True/False field is a switch: `--sp`, `drop --sp`)."""

    def __init__(self, template: str, values: dict, fixes=(), note: str = ""):
        self.template, self.values, self.note = template, dict(values), note
        self.fixes = [dict(f) for f in fixes]
        super().__init__(self._render(None))

    def __reduce__(self):                 # picklable (a rank may send one back), args intact
        return type(self), (self.template, self.values, self.fixes, self.note)

    def as_flags(self, flags: dict[str, str]) -> str:
        return self._render(flags)

    def _render(self, flags: dict[str, str] | None) -> str:
        def name(field, value, fix=False):
            return option_name(field, value, flags, fix)

        text = self.template.format(**{f: name(f, v) for f, v in self.values.items()})
        if self.note and flags is None:
            text += f" ({self.note})"
        if self.fixes:
            text += "; use " + " or ".join(" ".join(name(f, v, fix=True) for f, v in fix.items())
                                           for fix in self.fixes)
        return text


def option_name(field: str, value, flags: dict[str, str] | None, fix: bool = False) -> str:
    """An option as a command line writes it, `--flag value` (a switch alone; False or None:
    `drop --flag` in a fix), when `flags` names its flag (or `field` is one); else `field=value`."""
    flag = field if field.startswith("--") else None if flags is None else flags.get(field)
    if flag is None:
        return f"{field}={value!r}"
    if value is True:
        return flag
    if value is False or value is None:
        return f"drop {flag}" if fix else f"no {flag}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def near(candidates, want) -> list:
    """The largest of `candidates` below `want` and the smallest above it (an error's fixes)."""
    below = [c for c in candidates if c < want]
    above = [c for c in candidates if c > want]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def next_multiple(n: int, step: int) -> int:
    return -(-n // step) * step


def check_adamw(lr: float, eps: float | None = None, *, lr_works: float = 1e-4,
                eps_works: float = 1e-8) -> None:
    """Refuse an AdamW learning rate or eps that is not a finite number > 0 (ConfigError).

    lr < 0 climbs the loss, nan/inf poison every weight at the first step, eps = 0 divides
    by zero where a gradient entry is 0: no comparison or training run means anything then."""
    for field, value, works in (("lr", lr, lr_works), ("eps", eps, eps_works)):
        if value is None and field == "eps":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ConfigError("{%s} must be a finite number > 0" % field, {field: value},
                              [{field: works}])


def check_number(name: str, value, what: str, works, *, minimum: float = 0.0,
                 allow_minimum: bool = False, integer: bool = False) -> None:
    """ConfigError unless `value` is a finite number above `minimum` (or equal, with
    allow_minimum): the one rule for a hyperparameter, shared by the command lines. `name` is a
    field (rendered --flag by a CLI) or a flag itself: `--lr nan: the learning rate must be a
    finite number > 0; use --lr 3e-4`. NaN fails every comparison, so `value < 0` lets it in."""
    kind = "an integer" if integer else "a finite number"
    bound = f"{'>=' if allow_minimum else '>'} {minimum:g}"
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) \
        and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= minimum if allow_minimum else value > minimum)
    if not ok:
        raise ConfigError("{%s}: %s must be %s %s" % (name, what, kind, bound), {name: value},
                          [{name: works}])


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
    # Activation recomputation in ParallelGPT (minitron/model/recompute.py): "full" keeps only each
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
    aux_loss_scope: str = "global"        # whose tokens the balance loss counts, per micro-batch:
    #                                       "global" every replica's (dp x ep x cp, Megatron-Core's
    #                                       global aux loss), "replica" each dp x ep replica's own
    expert_bias: bool = False             # aux-loss-free balancing (DeepSeek-V3): a per-expert
    #                                       bias added to the scores for choosing only
    bias_update_rate: float = 1e-3        # gamma: after every optimizer step each expert's bias
    #                                       moves by +-gamma toward the mean load (DeepSeek-V3's
    #                                       0.001; Megatron-Core's moe_router_bias_update_rate)
    max_groups: int | None = None         # node-limited routing (moe/router.py): each token's
    expert_groups: int | None = None      # experts lie in its max_groups best of expert_groups
    #                                       equal groups (None, None: no limit)

    def __post_init__(self):
        for field in ("vocab_size", "seq_len", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            value = getattr(self, field)
            optional = field in ("n_kv_heads", "ffn_hidden")   # None: the default described above
            if not (optional and value is None) and (type(value) is not int or value < 1):
                raise ConfigError("{%s} must be a positive integer%s"
                                  % (field, " or None" if optional else ""),
                                  {field: value}, [{field: _default(field)}], note=f"ModelConfig.{field}")
        for field, allowed in CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ConfigError("{%s}: choose one of %s" % (field, allowed),
                                  {field: getattr(self, field)}, [{field: allowed[0]}])
        if self.hidden % self.n_heads:
            raise ConfigError("{hidden} is not divisible by {n_heads}: every head has hidden/n_heads "
                              "features", {"hidden": self.hidden, "n_heads": self.n_heads},
                              [{"n_heads": a} for a in near([a for a in divisors(self.hidden) if a % (self.n_kv_heads or 1) == 0],
                                                             self.n_heads)])
        if self.n_heads % self.kv_heads:
            raise ConfigError("{n_heads} is not a multiple of {n_kv_heads}: query heads share "
                              "key/value heads in equal groups",
                              {"n_heads": self.n_heads, "n_kv_heads": self.kv_heads},
                              [{"n_kv_heads": k} for k in near(divisors(self.n_heads), self.kv_heads)])
        if self.position == "rope" and self.head_dim % 2:
            even = [a for a in divisors(self.hidden) if (self.hidden // a) % 2 == 0]
            raise ConfigError("rotary positions need an even head_dim, but {hidden} / {n_heads} = "
                              f"{self.head_dim}", {"hidden": self.hidden, "n_heads": self.n_heads},
                              [{"n_heads": a} for a in near(even, self.n_heads)] or [{"position": "learned"}])
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("{dropout} must be in [0, 1)", {"dropout": self.dropout}, [{"dropout": 0.1}])
        self._validate_moe()

    def _validate_moe(self) -> None:
        if type(self.n_experts) is not int or self.n_experts < 0:
            raise ConfigError("{n_experts} must be an integer >= 0 (0: dense MLPs)",
                              {"n_experts": self.n_experts}, [{"n_experts": 0}], note="ModelConfig.n_experts")
        if self.expert_bias and not self.n_experts:
            raise ConfigError("{expert_bias} steers the routers of MoE layers, and {n_experts} "
                              "has none", {"expert_bias": True, "n_experts": 0},
                              [{"n_experts": 4}, {"expert_bias": False}])
        if self.max_groups is not None and not self.n_experts:
            raise ConfigError("{max_groups} limits the routers of MoE layers, and {n_experts} has none",
                              {"max_groups": self.max_groups, "n_experts": 0},
                              [{"n_experts": 8}, {"max_groups": None}])
        if not self.n_experts:
            return
        rate = self.bias_update_rate
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and 0 < rate < math.inf):
            raise ConfigError("{bias_update_rate} must be a finite number > 0 (the bias step per "
                              "optimizer step)", {"bias_update_rate": rate},
                              [{"bias_update_rate": 1e-3}])
        if type(self.topk) is not int or not 1 <= self.topk <= self.n_experts:
            raise ConfigError("{topk}: each token picks topk of the {n_experts} experts, "
                              f"1 <= topk <= {self.n_experts}",
                              {"topk": self.topk, "n_experts": self.n_experts},
                              [{"topk": min(2, self.n_experts)}])
        if type(self.moe_every) is not int or not 1 <= self.moe_every <= self.n_layers:
            raise ConfigError("{moe_every}: choose 1 (every layer) to {n_layers} (layer 0 only)",
                              {"moe_every": self.moe_every, "n_layers": self.n_layers}, [{"moe_every": 1}])
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                               or not (0 < cf < math.inf)):
            raise ConfigError("{capacity_factor}: use a finite number > 0 (tokens per expert = "
                              "ceil(factor * seq * topk / n_experts)), or leave it unset for dropless routing",
                              {"capacity_factor": cf}, [{"capacity_factor": 1.0}, {"capacity_factor": None}])
        for field in ("aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ConfigError("{%s} must be a finite number >= 0" % field, {field: value},
                                  [{field: _default(field)}])
        self._validate_groups()
        if self.recompute == "full":
            raise ConfigError("{recompute} reruns each block under a checkpoint whose first "
                              "forward keeps no graph, so the routers' auxiliary losses would get "
                              "no gradient", {"recompute": "full"},
                              [{"recompute": "selective"}, {"recompute": "none"}], note="with experts")
        if self.topk == 1 and not self.router_pre_softmax and self.aux_loss_coeff == 0 \
                and self.z_loss_coeff == 0:
            raise ConfigError("{topk} with {router_pre_softmax} gives every token the gate "
                              "softmax([x]) = 1, so the router never learns",
                              {"topk": 1, "router_pre_softmax": False},
                              [{"router_pre_softmax": True}, {"aux_loss_coeff": 0.01}])

    def _validate_groups(self) -> None:
        """Node-limited routing: G divides E, 1 <= M <= G, M divides topk, k/M <= E/G."""
        G, M, E, k = self.expert_groups, self.max_groups, self.n_experts, self.topk
        if M is None:
            if G is not None:
                raise ConfigError("{expert_groups} groups the experts for {max_groups}",
                                  {"expert_groups": G, "max_groups": None},
                                  [{"max_groups": 1}, {"expert_groups": None}])
            return
        if type(G) is not int or G < 1 or E % G:
            raise ConfigError("{expert_groups} must divide {n_experts} (equal groups)",
                              {"expert_groups": G, "n_experts": E},
                              [{"expert_groups": g} for g in near(divisors(E), G if type(G) is int else 1)])
        if type(M) is not int or not 1 <= M <= G:
            raise ConfigError("{max_groups}: each token keeps 1 to {expert_groups} groups",
                              {"max_groups": M, "expert_groups": G}, [{"max_groups": 1}])
        if k % M or k // M > E // G:
            works = [m for m in divisors(k) if m <= G and k // m <= E // G]
            raise ConfigError("{max_groups} must divide {topk} into topk/max_groups experts per "
                              f"group, at most the {E // G} a group has", {"max_groups": M, "topk": k},
                              [{"max_groups": m} for m in near(works, M)] or [{"topk": M}])

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


def _default(field: str):
    return next(f.default for f in dataclasses.fields(ModelConfig) if f.name == field)
