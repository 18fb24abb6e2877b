"""Does a model split on a grid? Every divisibility a split needs, checked before any rank starts.

Each refusal is a ConfigError (minitron/config.py) that names the clashing fields and the nearest
values that work, so a command can say which flag to change and to what; then the combinations
of options no split model is built for (minitron/refusals/, level model: Refused)."""
from __future__ import annotations

import dataclasses
import math

from .. import refusals
from ..grid import ParallelConfig, pad_vocab_size
from ..config import ConfigError, divisors, near, next_multiple


def validate_model(cfg: ParallelConfig, model, seq_len: int | None = None, *,
                   suggest: bool = True) -> None:
    """Check that `model` (a ModelConfig or anything with the same fields) splits on `cfg`.

    Raises ConfigError naming the clashing fields and values that work (the nearest ones)."""
    heads, kv = model.n_heads, getattr(model, "n_kv_heads", None) or model.n_heads
    ffn = getattr(model, "ffn", None)

    def working(dim: str, values) -> list[dict]:     # the nearest values that pass every check
        def ok(v):
            try:
                validate_model(dataclasses.replace(cfg, **{dim: v}), model, seq_len, suggest=False)
            except ValueError:
                return False
            return True
        if not suggest:
            return []
        good = [v for v in values if v != getattr(cfg, dim) and ok(v)]
        return [{dim: v} for v in near(good, getattr(cfg, dim))]

    tp_works = divisors(math.gcd(heads, kv, ffn or heads))      # tp must divide all three
    if heads % cfg.tp:
        raise ConfigError("{n_heads} is not divisible by {tp}: each tensor-parallel rank must own "
                          "whole heads", {"n_heads": heads, "tp": cfg.tp},
                          working("tp", tp_works))
    if kv % cfg.tp:
        raise ConfigError("{n_kv_heads} is not divisible by {tp}: each tensor-parallel rank must "
                          "own whole key/value heads", {"n_kv_heads": kv, "tp": cfg.tp},
                          working("tp", tp_works) + [{"n_kv_heads": k} for k in divisors(heads)
                                                     if k > kv and k % cfg.tp == 0][:1])
    if ffn is not None and ffn % cfg.tp:
        raise ConfigError("{ffn_hidden} is not divisible by {tp}: each rank must own whole MLP "
                          "columns", {"ffn_hidden": ffn, "tp": cfg.tp},
                          working("tp", tp_works))
    layers, chunks = model.n_layers, cfg.pp * cfg.virtual_pp
    if layers % chunks:
        pp_works = [p for p in divisors(layers) if layers % (p * cfg.virtual_pp) == 0]
        raise ConfigError("{n_layers} is not divisible by {pp} * {virtual_pp}: every "
                          "pipeline chunk needs the same number of layers",
                          {"n_layers": layers, "pp": cfg.pp, "virtual_pp": cfg.virtual_pp},
                          working("pp", pp_works)
                          + [{"n_layers": next_multiple(layers, chunks)}])
    if model.vocab_size % cfg.tp:
        raise ConfigError("{vocab_size} is not divisible by {tp}: pad it (the extra rows are never "
                          "a target)", {"vocab_size": model.vocab_size, "tp": cfg.tp},
                          [{"vocab_size": pad_vocab_size(model.vocab_size, cfg.tp)}],
                          note="minitron.grid.pad_vocab_size")
    experts = getattr(model, "n_experts", 0) or 0
    if experts and experts % cfg.ep:
        raise ConfigError("{n_experts} is not divisible by {ep}: every expert-parallel rank must "
                          "own the same number of experts", {"n_experts": experts, "ep": cfg.ep},
                          working("ep", divisors(experts))
                          + [{"n_experts": next_multiple(experts, cfg.ep)}])
    s = seq_len if seq_len is not None else model.seq_len
    if cfg.sequence_parallel and s % (cfg.tp * cfg.cp):
        raise ConfigError("{seq_len} is not divisible by {tp} * {cp}: sequence parallelism splits "
                          "every sequence over tp * cp ranks", {"seq_len": s, "tp": cfg.tp, "cp": cfg.cp},
                          [{"seq_len": next_multiple(s, cfg.tp * cfg.cp)}])
    if cfg.cp > 1 and s % (2 * cfg.cp):
        cp_works = [c for c in range(1, cfg.cp * 2 + 1) if c == 1 or s % (2 * c) == 0]
        raise ConfigError("{seq_len} is not divisible by 2 * {cp}: context "
                          "parallelism cuts each sequence into 2*cp chunks to balance causal work",
                          {"seq_len": s, "cp": cfg.cp},
                          working("cp", cp_works)
                          + [{"seq_len": next_multiple(s, 2 * cfg.cp)}])
    a2a = {"ulysses": "cp", "hierarchical": "cp_a2a"}.get(cfg.cp_variant)   # heads split this way
    if cfg.cp > 1 and a2a and ((heads // cfg.tp) % getattr(cfg, a2a) or (kv // cfg.tp) % getattr(cfg, a2a)):
        per_rank = math.gcd(heads // cfg.tp, kv // cfg.tp)
        raise ConfigError(f"{{cp_variant}} gives each of the {{{a2a}}} ranks whole heads, but a "
                          f"tensor-parallel rank has {heads // cfg.tp} query and {kv // cfg.tp} "
                          "key/value heads", {"cp_variant": cfg.cp_variant, a2a: getattr(cfg, a2a)},
                          working(a2a, divisors(per_rank))
                          + [{"cp_variant": "ring"}, {"cp_variant": "allgather"}])
    refusals.check_model(cfg, model)          # the combinations no split model is built for
