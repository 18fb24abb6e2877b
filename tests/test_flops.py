"""estimate/flops.py and python -m minitron.estimate flops against Narayanan et al. (2021)'s
formulas and figures, and against the FLOPs torch itself counts (torch.utils.flop_counter) on a
small model."""
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minitron.estimate import flops, flops_cli
from minitron.estimate.memory import PRESETS, rank_params
from minitron.config import ModelConfig
from minitron.model.reference import GPT
from minitron.model.recompute import checkpoint


@pytest.mark.parametrize("name", ["gpt3-175b", "1t", "gpt2-medium"])
@pytest.mark.parametrize("b", [1, 8])
def test_full_recompute_is_the_papers_96Bslh2_formula(name, b):
    cfg = PRESETS[name]
    s, l, h, V = cfg.seq_len, cfg.n_layers, cfg.hidden, cfg.vocab_size
    got = flops.iteration_flops(cfg, b, recompute="full")
    assert got == pytest.approx(flops.narayanan_flops(b, s, l, h, V), rel=1e-12)
    none = 72 * b * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert flops.iteration_flops(cfg, b, recompute="none") == pytest.approx(none, rel=1e-12)
    # selective recomputes the attention core only: QK^T and PV, 4Bs^2h per layer
    assert flops.iteration_flops(cfg, b, recompute="selective") == \
        flops.iteration_flops(cfg, b) + l * 4 * b * s * s * h


def test_parameter_counts_of_the_paper():
    # Narayanan et al., Table 1: 1008.0B for l=128, h=25600 (and 145.6B, 310.1B, 529.6B);
    # GPT-3's 96 x 12288 is 174.6B with Megatron's vocabulary of 51200.
    for (l, h), billions in {(128, 25600): 1008.0, (80, 12288): 145.6, (96, 16384): 310.1,
                             (105, 20480): 529.6, (96, 12288): 174.6}.items():
        assert round(flops.narayanan_params(l, h, 51200, 2048) / 1e9, 1) == billions
    # minitron's own count (from the sharding rules) is P plus the final norm's 2h
    for name in ("gpt3-175b", "1t"):
        cfg = PRESETS[name]
        p = flops.narayanan_params(cfg.n_layers, cfg.hidden, cfg.vocab_size, cfg.seq_len)
        assert rank_params(cfg) == pytest.approx(p + 2 * cfg.hidden, abs=0.5)


def test_training_time_figures_of_the_paper():
    # Section 5.1: GPT-3 (175B) on 300B tokens, 1024 A100s at 140 TFLOP/s: about 34 days;
    # the 1T model on 450B tokens, 3072 A100s at 163 TFLOP/s: about 84 days.
    day = 86400
    assert round(flops.training_seconds(300e9, 174.6e9, 1024, 140e12) / day) == 34
    assert round(flops.training_seconds(450e9, 1008e9, 3072, 163e12) / day) == 84


def test_throughput_and_mfu():
    cfg = PRESETS["gpt3-175b"]
    model = flops.iteration_flops(cfg, 1536)
    hw = flops.iteration_flops(cfg, 1536, recompute="full")
    rates = flops.throughput(cfg, 1536, seconds=30.0, gpus=1024, peak=312e12, recompute="full")
    assert rates["tokens/s"] == 1536 * 2048 / 30.0
    assert rates["MFU"] == pytest.approx(model / 30.0 / 1024 / 312e12)
    assert rates["HFU"] == pytest.approx(hw / 30.0 / 1024 / 312e12)
    assert rates["HFU"] / rates["MFU"] == pytest.approx(4 / 3, rel=0.02)   # ~ one more forward
    assert "MFU" not in flops.throughput(cfg, 1, seconds=1.0)               # no peak, no MFU
    with pytest.raises(ValueError, match="seconds must be positive"):
        flops.throughput(cfg, 1, seconds=0)


# ---- against what torch counts ------------------------------------------------------------
TINY = [ModelConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4, dropout=0.1),
        ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    activation="swiglu", ffn_hidden=48)]


def _counted(cfg, b, recompute):
    """Matmul FLOPs torch counts in one forward + backward of the reference GPT; with "full",
    each block is run through minitron.model.recompute.checkpoint (recomputed in backward)."""
    model = GPT(cfg, seed=0).train()
    if recompute == "full":
        for block in model.layers:
            forward = block.forward
            block.forward = lambda x, rng, f=forward: checkpoint(f, rng, x, others=(rng,))
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(tokens, tokens)
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg", TINY, ids=["gelu-mha", "swiglu-gqa"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_formula_equals_torch_flop_counter(cfg, recompute):
    counted = _counted(cfg, 3, recompute)
    assert flops.iteration_flops(cfg, 3, recompute=recompute) == counted
    # the test can fail: forgetting the recomputation (or counting it when absent) is caught
    other = "none" if recompute == "full" else "full"
    assert flops.iteration_flops(cfg, 3, recompute=other) != counted


def test_cli(capsys):
    assert flops_cli.main(["--model", "1t", "--batch", "3072", "--seconds", "100", "--gpus", "3072",
                       "--peak", "312e12"]) == 0
    out = capsys.readouterr().out
    assert "FLOPs per iteration: 5.139e+19 (recompute=full)" in out
    assert re.search(r"MFU 0\.40\d+, HFU 0\.53\d+", out)
    assert flops_cli.main(["--model", "gpt5"]) == 2
    assert "unknown model 'gpt5'" in capsys.readouterr().err
