"""Hugging Face interop: GPT-2 and Llama-style weights into minitron's layout, and back.

    cfg = hf.config_from_hf(hf_model.config)             # the same shape as a ModelConfig
    ref = hf.import_model(hf_model)                       # a single-device minitron GPT
    shard = hf.import_model(hf_model, grid)               # this rank's ParallelGPT (or a pipeline
                                                          # rank's PipelineGPT, with placement=)
    hf_sd = hf.export_state_dict(ref.state_dict(), cfg, "llama")   # back to transformers' names

Everything goes through the reference layout: the name maps below turn a transformers state
dict into the reference GPT's, and model/convert.py's rules cut that for any grid (and gather
it back). `transformers` is an optional extra: the maps need only torch; building a
transformers config or model (hf_config) needs the package.

What differs between the layouts:
  GPT-2   Conv1D weights are stored [in, out] (transposed); one c_attn = [q; k; v] along the
          output; learned positions; tied output layer; biases everywhere. Its activation is
          "gelu_new" (tanh approximation): minitron's GELU is the exact one, so only GPT-2
          models configured with activation_function="gelu" give equal logits; others refuse.
  Llama   q/k/v/o, gate/up/down projections without biases, RMSNorm, rotary positions on
          halves (rotate_half: the reference's convention, so no permutation), SwiGLU.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig

FAMILIES = ("gpt2", "llama")
_LLAMA_TYPES = ("llama", "mistral")


def family_of(hf_config) -> str:
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        return "gpt2"
    if kind in _LLAMA_TYPES:
        return "llama"
    raise ValueError(f"model_type={kind!r}: minitron imports GPT-2 and Llama-style models "
                     f"({', '.join(('gpt2',) + _LLAMA_TYPES)})")


def config_from_hf(hf_config) -> ModelConfig:
    """The ModelConfig with the same shape and arithmetic as a transformers config."""
    c, family = hf_config, family_of(hf_config)
    if family == "gpt2":
        if c.activation_function != "gelu":
            raise ValueError(f"GPT-2 activation_function={c.activation_function!r}: minitron's GELU "
                             "is the exact one; use a GPT2Config(activation_function='gelu') model, "
                             "or accept that logits will differ by the tanh approximation")
        drops = {name: float(getattr(c, name)) for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop")}
        if len(set(drops.values())) > 1:
            raise ValueError(f"GPT-2 dropout {drops}: minitron has one dropout probability for the "
                             "embedding, the attention probabilities and the residuals; set all "
                             "three equal")
        return ModelConfig(vocab_size=c.vocab_size, seq_len=c.n_positions, hidden=c.n_embd,
                           n_layers=c.n_layer, n_heads=c.n_head,
                           ffn_hidden=None if c.n_inner in (None, 4 * c.n_embd) else c.n_inner,
                           norm="layernorm", activation="gelu", position="learned",
                           dropout=drops["resid_pdrop"], tie_embeddings=True, bias=True,
                           norm_eps=c.layer_norm_epsilon)
    if getattr(c, "attention_dropout", 0.0):
        raise ValueError(f"Llama attention_dropout={c.attention_dropout}: minitron's dropout also "
                         "drops the embedding and the residuals, which Llama never does; import "
                         "with attention_dropout=0.0")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("Llama with attention_bias/mlp_bias: minitron's bias flag covers every "
                         "linear layer at once; import a model without biases")
    scaling = getattr(c, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"rope_scaling={scaling!r} is not implemented in minitron")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"head_dim={head_dim} x heads != hidden={c.hidden_size}: minitron needs "
                         "hidden = heads x head_dim")
    rope = (getattr(c, "rope_theta", None) or scaling.get("rope_theta")
            or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    return ModelConfig(vocab_size=c.vocab_size, seq_len=c.max_position_embeddings,
                       hidden=c.hidden_size, n_layers=c.num_hidden_layers,
                       n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                       ffn_hidden=c.intermediate_size, norm="rmsnorm", activation="swiglu",
                       position="rope", tie_embeddings=bool(c.tie_word_embeddings), bias=False,
                       norm_eps=c.rms_norm_eps, rope_base=float(rope))


# ---- name maps: (transformers name, reference name, transposed) --------------------------------
def _gpt2_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    out = [("transformer.wte.weight", "embedding.word.weight", False),
           ("transformer.wpe.weight", "embedding.position.weight", False)]
    for i in range(cfg.n_layers):
        h, r = f"transformer.h.{i}", f"layers.{i}"
        for k in ("weight", "bias"):
            out += [(f"{h}.ln_1.{k}", f"{r}.attn_norm.{k}", False),
                    (f"{h}.ln_2.{k}", f"{r}.mlp_norm.{k}", False),
                    (f"{h}.attn.c_proj.{k}", f"{r}.attention.out.{k}", k == "weight"),
                    (f"{h}.mlp.c_fc.{k}", f"{r}.mlp.fc1.{k}", k == "weight"),
                    (f"{h}.mlp.c_proj.{k}", f"{r}.mlp.fc2.{k}", k == "weight")]
    return out + [("transformer.ln_f.weight", "final_norm.weight", False),
                  ("transformer.ln_f.bias", "final_norm.bias", False)]


def _llama_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    out = [("model.embed_tokens.weight", "embedding.word.weight", False)]
    for i in range(cfg.n_layers):
        h, r = f"model.layers.{i}", f"layers.{i}"
        out += [(f"{h}.input_layernorm.weight", f"{r}.attn_norm.weight", False),
                (f"{h}.post_attention_layernorm.weight", f"{r}.mlp_norm.weight", False),
                (f"{h}.self_attn.q_proj.weight", f"{r}.attention.q.weight", False),
                (f"{h}.self_attn.k_proj.weight", f"{r}.attention.k.weight", False),
                (f"{h}.self_attn.v_proj.weight", f"{r}.attention.v.weight", False),
                (f"{h}.self_attn.o_proj.weight", f"{r}.attention.out.weight", False),
                (f"{h}.mlp.gate_proj.weight", f"{r}.mlp.gate.weight", False),
                (f"{h}.mlp.up_proj.weight", f"{r}.mlp.fc1.weight", False),
                (f"{h}.mlp.down_proj.weight", f"{r}.mlp.fc2.weight", False)]
    out.append(("model.norm.weight", "final_norm.weight", False))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", "lm_head.weight", False))
    return out


def _names(cfg: ModelConfig, family: str):
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: choose one of {FAMILIES}")
    return _gpt2_names(cfg) if family == "gpt2" else _llama_names(cfg)


def import_state_dict(hf_sd: dict, cfg: ModelConfig, family: str) -> dict:
    """A transformers state dict -> the reference GPT's (clones, contiguous)."""
    missing = [n for n, _, _ in _names(cfg, family) if n not in hf_sd]
    if family == "gpt2":
        missing += [f"transformer.h.{i}.attn.c_attn.{k}" for i in range(cfg.n_layers)
                    for k in ("weight", "bias") if f"transformer.h.{i}.attn.c_attn.{k}" not in hf_sd]
    if missing:
        raise ValueError(f"the {family} state dict lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}: "
                         "is it the model the config describes?")
    ref = {r: (hf_sd[h].t() if t else hf_sd[h]).contiguous().clone() for h, r, t in _names(cfg, family)}
    if family == "gpt2":             # c_attn [h, 3h] (Conv1D) = [q | k | v] along its output
        for i in range(cfg.n_layers):
            w = hf_sd[f"transformer.h.{i}.attn.c_attn.weight"].t()
            b = hf_sd[f"transformer.h.{i}.attn.c_attn.bias"]
            for name, wp, bp in zip("qkv", w.chunk(3, 0), b.chunk(3, 0)):
                ref[f"layers.{i}.attention.{name}.weight"] = wp.contiguous().clone()
                ref[f"layers.{i}.attention.{name}.bias"] = bp.contiguous().clone()
    return ref


def export_state_dict(ref_sd: dict, cfg: ModelConfig, family: str) -> dict:
    """The reference GPT's state dict -> transformers' names and layouts."""
    hf = {h: (ref_sd[r].t() if t else ref_sd[r]).contiguous().clone() for h, r, t in _names(cfg, family)}
    if family == "gpt2":
        for i in range(cfg.n_layers):
            a = f"layers.{i}.attention"
            hf[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
                [ref_sd[f"{a}.{n}.weight"] for n in "qkv"], 0).t().contiguous()
            hf[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([ref_sd[f"{a}.{n}.bias"] for n in "qkv"])
        hf["lm_head.weight"] = hf["transformer.wte.weight"]
    elif cfg.tie_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf


# ---- whole models ----------------------------------------------------------------------------
def import_model(hf_model, grid=None, placement=None, seed: int = 0):
    """A minitron model holding `hf_model`'s weights: the single-device GPT without a grid,
    else this rank's ParallelGPT (PipelineGPT when `placement` is given). No communication."""
    from ..model.convert import shard_state_dict
    from ..model.reference import GPT
    cfg = config_from_hf(hf_model.config)
    ref_sd = import_state_dict(hf_model.state_dict(), cfg, family_of(hf_model.config))
    dtype = next(hf_model.parameters()).dtype
    if grid is None:
        model = GPT(cfg, seed)
        model.load_state_dict(ref_sd)
        return model.to(dtype)
    if placement is None and grid.config.pp == 1:
        from ..model.parallel import ParallelGPT
        model = ParallelGPT(cfg, grid, seed=seed)
    else:
        from ..model.stages import PipelineGPT
        model = PipelineGPT(cfg, grid, placement, seed=seed)
        placement = model.placement
    model.load_state_dict(shard_state_dict(ref_sd, cfg, grid, placement))
    return model.to(device=grid.device, dtype=dtype)


def export_model(model, hf_model_or_config, engine=None):
    """A transformers model holding minitron `model`'s weights (a GPT, or a ParallelGPT /
    PipelineGPT rank: then collective, gathered across tp and pp; ZeRO-3: pass its engine).

    Returned in eval mode, as from_pretrained returns one: with dropout > 0 a model in training
    mode would give other logits than its twin on every call (call .train() to train it)."""
    cfg = model.cfg
    if hasattr(model, "grid"):
        from .checkpoint import local_weights
        from ..model.convert import gather_state_dict
        ref_sd = gather_state_dict(dict(local_weights(model, engine)), cfg, model.grid,
                                   getattr(model, "placement", None))
    else:
        ref_sd = model.state_dict()
    hf_config = getattr(hf_model_or_config, "config", hf_model_or_config)
    hf = hf_model_or_config if hasattr(hf_model_or_config, "config") else build_hf_model(hf_config)
    sd = export_state_dict(ref_sd, cfg, family_of(hf_config))
    hf.load_state_dict(sd, strict=False)
    _check_all_loaded(hf, sd)
    return hf.eval()


def _check_all_loaded(hf, sd: dict) -> None:
    left = [n for n, _ in hf.named_parameters() if n not in sd]
    if left:
        raise ValueError(f"export left {left[:3]} of the transformers model unset")


def build_hf_model(hf_config):
    """A transformers causal LM for `hf_config` (needs `pip install transformers`)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("this needs transformers, an optional extra: pip install transformers") from None
    return transformers.AutoModelForCausalLM.from_config(hf_config)


def hf_config(cfg: ModelConfig, family: str):
    """A transformers config with cfg's shape (needs transformers)."""
    import transformers
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len,
                                       n_embd=cfg.hidden, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                                       n_inner=cfg.ffn_hidden, activation_function="gelu",
                                       layer_norm_epsilon=cfg.norm_eps, resid_pdrop=cfg.dropout,
                                       embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                                       bos_token_id=None, eos_token_id=None)
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: Llama drops only attention probabilities, minitron "
                         "also the embedding and the residuals; export with dropout=0")
    return transformers.LlamaConfig(vocab_size=cfg.vocab_size, max_position_embeddings=cfg.seq_len,
                                    hidden_size=cfg.hidden, num_hidden_layers=cfg.n_layers,
                                    num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                                    intermediate_size=cfg.ffn, rms_norm_eps=cfg.norm_eps,
                                    rope_theta=cfg.rope_base, tie_word_embeddings=cfg.tie_embeddings,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


__all__ = ["FAMILIES", "family_of", "config_from_hf", "import_state_dict", "export_state_dict",
           "import_model", "export_model", "build_hf_model", "hf_config"]
