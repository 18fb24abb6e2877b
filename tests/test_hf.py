"""Hugging Face interop: transformers' GPT-2 and Llama weights in minitron, logits equal, sharded
or not, and back. The name maps are checked without transformers; the logits need it."""
import importlib.util

import pytest
import torch

from minitron.train import hf
from minitron.grid import ParallelConfig, build_grid
from minitron.config import ModelConfig
from minitron.model.reference import GPT

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="needs transformers (pip install transformers: the optional hf extra)")
TOL = 1e-4      # fp32 logits, same arithmetic in another order (measured below ~1e-5)

GPT2 = ModelConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4,
                   tie_embeddings=True)
LLAMA = ModelConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=48, norm="rmsnorm", activation="swiglu", position="rope", bias=False)


@pytest.mark.parametrize("family, cfg", [("gpt2", GPT2), ("llama", LLAMA)])
def test_name_maps_round_trip(family, cfg):
    ref = GPT(cfg, seed=1).state_dict()
    out = hf.export_state_dict(ref, cfg, family)
    back = hf.import_state_dict(out, cfg, family)
    assert back.keys() == ref.keys()
    assert all(torch.equal(back[k], ref[k]) for k in ref)
    if family == "gpt2":     # Conv1D: [in, out]; c_attn = [q | k | v]
        assert out["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
        k = out["transformer.h.0.attn.c_attn.weight"][:, 32:64]
        assert torch.equal(k, ref["layers.0.attention.k.weight"].t())
    with pytest.raises(ValueError, match="lacks"):
        hf.import_state_dict({}, cfg, family)


def make_hf(family, cfg):
    torch.manual_seed(0)
    model = hf.build_hf_model(hf.hf_config(cfg, family)).float().eval()
    with torch.no_grad():                     # random, non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(cfg):
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(3))


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@needs_transformers
@pytest.mark.parametrize("family, cfg", [("gpt2", GPT2), ("llama", LLAMA)])
def test_imported_logits_equal_transformers(family, cfg):
    model = make_hf(family, cfg)
    assert hf.config_from_hf(model.config) == cfg
    ids = tokens(cfg)
    with torch.no_grad():
        want = model(ids).logits
        ours = hf.import_model(model)(ids)
        back = hf.export_model(hf.import_model(model), model.config)(ids).logits
    assert rel_err(ours, want) < TOL and torch.equal(back, want)
    broken = hf.import_model(model)
    with torch.no_grad():
        w = broken.embedding.word.weight                   # test of the test: rows shifted by one
        w.copy_(w.roll(1, 0))
        assert rel_err(broken(ids), want) > 100 * TOL


def sharded_rank(family, cfg, pcfg):
    model = make_hf(family, cfg)
    grid = build_grid(pcfg)
    ids = tokens(cfg)
    ours = hf.import_model(model, grid)
    from minitron.runtime import comm
    with torch.no_grad():
        logits = comm.all_gather(ours(ids), grid.tp, dim=-1)
        want = model(ids).logits
        exported = hf.export_model(ours, model.config)(ids).logits
    return rel_err(logits, want), torch.equal(exported, want)


@needs_transformers
@pytest.mark.parametrize("family, cfg", [("gpt2", GPT2), ("llama", LLAMA)])
def test_sharded_import_and_export(run_ranks, family, cfg):
    for err, exact in run_ranks(sharded_rank, family, cfg, ParallelConfig(tp=2, sequence_parallel=True),
                                world_size=2):
        assert err < TOL and exact


def pipeline_round_trip_rank(family, cfg):
    model = make_hf(family, cfg)
    ours = hf.import_model(model, build_grid(ParallelConfig(pp=2)))     # this rank's stage
    with torch.no_grad():
        return torch.equal(hf.export_model(ours, model.config)(tokens(cfg)).logits, model(tokens(cfg)).logits)


@needs_transformers
@pytest.mark.parametrize("family, cfg", [("gpt2", GPT2), ("llama", LLAMA)])
def test_pipeline_stages_export_back_exactly(run_ranks, family, cfg):
    assert all(run_ranks(pipeline_round_trip_rank, family, cfg, world_size=2))


@needs_transformers
def test_gpt2_dropout_is_kept_and_exported_models_are_in_eval_mode():
    """GPT-2's dropout (0.1 in the released models) comes into ModelConfig.dropout, and an
    exported model is in eval mode: in training mode its logits would differ from the original's
    on every call (by ~0.45 at 0.1) with identical weights."""
    import dataclasses
    cfg = dataclasses.replace(GPT2, dropout=0.1)
    model = make_hf("gpt2", cfg)
    assert hf.config_from_hf(model.config) == cfg
    ids = tokens(cfg)
    exported = hf.export_model(hf.import_model(model), model.config)
    assert not exported.training
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model(ids).logits)
        assert not torch.equal(exported.train()(ids).logits, model(ids).logits)   # test of the test
    uneven = hf.hf_config(cfg, "gpt2")
    uneven.attn_pdrop = 0.0
    with pytest.raises(ValueError, match="one dropout probability"):
        hf.config_from_hf(uneven)
    with pytest.raises(ValueError, match="export with dropout=0"):
        hf.hf_config(dataclasses.replace(LLAMA, dropout=0.1), "llama")
