"""ParallelGPT against the reference GPT: numbers, shards, replicas, bytes, and planted bugs.

Each numerical test runs minitron.verify's per-rank body (logits, loss, dL/dX, every weight
gradient and every updated weight after AdamW, compared on rank 0 with the verifier's
tolerances), so the tests and `python -m minitron.verify` check the same thing.
"""

import os

import pytest
import torch

from minitron.runtime import comm
from minitron.grid import ParallelConfig, build_grid
from minitron.model import GPT, ModelConfig, ParallelGPT, gather_state_dict, shard_state_dict
from minitron.model import parallel as parallel_mod
from minitron.tensor_parallel import layers as layers_mod
from minitron.train.step import parallel_step
from minitron.verify import make_batch, run_rank
from minitron.verify.checks import pattern

BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4)
CONFIGS = {
    # name: (tp, sequence_parallel, model options)
    "tp2-layernorm-gelu-learned-dropout": (2, False, dict(dropout=0.1)),
    "tp2-sp-layernorm-gelu-learned-dropout": (2, True, dict(dropout=0.1)),
    "tp2-sp-gqa-rope-untied": (2, True, dict(n_kv_heads=2, position="rope")),
    "tp4-sp-rmsnorm-swiglu-rope-gqa-tied": (4, True, dict(
        n_kv_heads=4, n_heads=8, norm="rmsnorm", activation="swiglu", position="rope",
        tie_embeddings=True, bias=False)),
    "tp4-rmsnorm-swiglu-rope-gqa-tied-dropout": (4, False, dict(
        n_kv_heads=4, n_heads=8, norm="rmsnorm", activation="swiglu", position="rope",
        tie_embeddings=True, dropout=0.1)),
}


def _configs(name):
    tp, sp, opts = CONFIGS[name]
    return ParallelConfig(tp=tp, sequence_parallel=sp), ModelConfig(**{**BASE, **opts})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(run_ranks, name):
    pcfg, mcfg = _configs(name)
    rows = run_ranks(run_rank, pcfg, mcfg, 2, world_size=pcfg.tp)[0]
    bad = [f"step {r.step} {r.quantity}: {r.err:.2e} > {r.tol:.0e}" for r in rows if not r.ok]
    assert not bad, "\n".join(bad)
    # Every reference parameter was compared, as a gradient and as an updated weight.
    names = {pattern(n) for n in GPT(mcfg).state_dict()}
    for kind in ("grad", "weight"):
        assert {r.quantity.split(" ", 1)[1] for r in rows if r.quantity.startswith(kind)} == names
    assert {r.quantity for r in rows} >= {"logits", "loss", "dL/dX"}


# ---- state dicts ----------------------------------------------------------------------------
SD_CONFIGS = [ModelConfig(**BASE),
              ModelConfig(**{**BASE, **CONFIGS["tp4-sp-rmsnorm-swiglu-rope-gqa-tied"][2]}),
              ModelConfig(**{**BASE, "n_kv_heads": 2, "activation": "swiglu", "bias": True})]


def _expected_shard(full: dict, key: str, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s tensor `key`, written out from the layout lessons 01 and 02 teach, not from
    convert.py's rules: column-parallel pieces keep rows r of each fused part ([q_r; k_r; v_r],
    [gate_r; fc1_r]), row-parallel weights columns r, vocab-parallel tables rows r, the rest whole."""
    mine = lambda t, dim=0: t.chunk(tp, dim=dim)[rank]
    parent, leaf = key.rsplit(".", 1)
    gate = parent.replace("fc1", "gate") + f".{leaf}"
    if parent.endswith("attention.qkv"):
        base = parent.removesuffix("qkv")
        return torch.cat([mine(full[f"{base}{p}.{leaf}"]) for p in "qkv"])
    if parent.endswith("mlp.fc1") and gate in full:
        return torch.cat([mine(full[gate]), mine(full[key])])
    if key.endswith(("mlp.fc1.weight", "mlp.fc1.bias", "word.weight", "lm_head.weight")):
        return mine(full[key])
    if key.endswith(("attention.out.weight", "mlp.fc2.weight")):
        return mine(full[key], dim=1)
    return full[key]                      # norms, row-parallel biases, positions: replicated


def _shard_gather_worker(tp):
    grid = build_grid(ParallelConfig(tp=tp))
    out = []
    for cfg in SD_CONFIGS:
        if cfg.kv_heads % tp:
            continue
        full = GPT(cfg, seed=3).state_dict()
        local = shard_state_dict(full, cfg, grid)
        back = gather_state_dict(local, cfg, grid)
        model = ParallelGPT(cfg, grid, seed=3)              # initialised like GPT(cfg, seed=3)
        out.append((back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full),
                    local.keys() == model.state_dict().keys()
                    and all(local[k].shape == v.shape for k, v in model.state_dict().items()),
                    [k for k, v in model.state_dict().items()
                     if not torch.equal(v, _expected_shard(full, k, grid.tp.rank, tp))]))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_then_gather_is_identity(run_ranks, tp):
    for rank_result in run_ranks(_shard_gather_worker, tp, world_size=tp):
        assert rank_result, "no configuration was checked"
        for identity, fits_model, wrong_shards in rank_result:
            assert identity, "gather(shard(sd)) != sd"
            assert fits_model, "shard_state_dict's keys/shapes differ from ParallelGPT's"
            assert not wrong_shards, f"ParallelGPT(cfg, grid, seed) is not GPT(cfg, seed) sharded: {wrong_shards}"


def test_expected_shard_oracle_catches_a_swapped_fused_order():
    # The test of the oracle: a [k_0; q_0; v_0] fused weight is not rank 0's [q_0; k_0; v_0].
    full = GPT(SD_CONFIGS[2], seed=3).state_dict()
    right = _expected_shard(full, "layers.0.attention.qkv.weight", 0, 2)
    q, k, v = (full[f"layers.0.attention.{p}.weight"].chunk(2)[0] for p in "qkv")
    assert torch.equal(right, torch.cat([q, k, v]))
    assert not torch.equal(right, torch.cat([k, q, v]))


# ---- replicated parameters stay identical across the tensor-parallel group ------------------
def _replicas_worker(name):
    pcfg, mcfg = _configs(name)
    model = ParallelGPT(mcfg, build_grid(pcfg), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        tokens, targets = make_batch(step, 0, 2, mcfg.seq_len, mcfg.vocab_size)
        parallel_step(model, tokens, targets, step)
        opt.step()
        opt.zero_grad()
    split = {"embedding.word.weight", "lm_head.weight"}
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if n not in split and not n.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias",
                                                  "out.weight", "fc2.weight"))}


@pytest.mark.parametrize("name", ["tp2-sp-layernorm-gelu-learned-dropout",
                                  "tp2-layernorm-gelu-learned-dropout"])
def test_replicated_params_identical_across_tp(run_ranks, name):
    per_rank = run_ranks(_replicas_worker, name, world_size=2)
    assert any("norm" in n for n in per_rank[0]) and "embedding.position.weight" in per_rank[0]
    for n, t in per_rank[0].items():
        assert torch.equal(t, per_rank[1][n]), f"{n} differs between tp ranks after 3 steps"


# ---- communication, counted exactly ---------------------------------------------------------
B = 2


def _comm_worker(name):
    pcfg, mcfg = _configs(name)
    model = ParallelGPT(mcfg, build_grid(pcfg), seed=0)
    tokens, targets = make_batch(0, 0, B, mcfg.seq_len, mcfg.vocab_size)
    with comm.counting() as c:
        parallel_step(model, tokens, targets, 0)
    return c.as_dict()


def _expected(name):
    """The whole training step's traffic on the tp group, {op: (calls, payload bytes)}.

    A = b*s*h*4 bytes, one activation. L layers. N = b*s tokens.
    Without SP, all-reduces of A:
        forward  1 (embedding g) + 2L (g after attention.out and mlp.fc2)
        backward 2L (f before attention.qkv and mlp.fc1) + 1 (f before the output layer)
      plus the loss: 3 all-reduces of N float32 (max, target logit, sum of exp), forward only.
    With SP each all-reduce of A becomes an all-gather and a reduce-scatter of payload A:
        all-gather      forward 2L + 1 (before qkv, fc1, output layer), backward 2L + 1
                        (the adjoint of the embedding's and the row layers' reduce-scatters)
        reduce-scatter  forward 1 + 2L, backward 2L + 1
      plus the loss's 3 all-reduces and one all-reduce of every sequence-parallel gradient
      (norm weights/biases, row-parallel biases, learned positions), flattened together.
    """
    pcfg, mcfg = _configs(name)
    L, h, s = mcfg.n_layers, mcfg.hidden, mcfg.seq_len
    A, N = B * s * h * 4, B * s
    loss = (3, 3 * N * 4)
    if not pcfg.sequence_parallel:
        n = 4 * L + 2
        return {"all_reduce": (n + loss[0], n * A + loss[1])}
    norm = h * (2 if mcfg.norm == "layernorm" else 1)
    sp_params = L * (2 * norm + (2 * h if mcfg.bias else 0)) + norm
    sp_params += mcfg.seq_len * h if mcfg.position == "learned" else 0
    n = 4 * L + 2
    return {"all_gather": (n, n * A), "reduce_scatter": (n, n * A),
            "all_reduce": (loss[0] + 1, loss[1] + sp_params * 4)}


@pytest.mark.parametrize("name", ["tp2-layernorm-gelu-learned-dropout",
                                  "tp2-sp-layernorm-gelu-learned-dropout",
                                  "tp4-sp-rmsnorm-swiglu-rope-gqa-tied"])
def test_communication_volume_exact(run_ranks, name):
    pcfg, _ = _configs(name)
    expected = _expected(name)
    for counts in run_ranks(_comm_worker, name, world_size=pcfg.tp):
        got = {key.split("/")[1]: (rec["calls"], rec["bytes"]) for key, rec in counts.items()}
        assert all(key.startswith("tp/") for key in counts), counts   # only the tp group talks
        assert got == expected


def test_sequence_parallel_moves_the_same_activation_bytes(run_ranks):
    """All-reduce = reduce-scatter + all-gather: on the wire, SP's activation traffic is TP's."""
    plain = run_ranks(_comm_worker, "tp2-layernorm-gelu-learned-dropout", world_size=2)[0]
    sp = run_ranks(_comm_worker, "tp2-sp-layernorm-gelu-learned-dropout", world_size=2)[0]
    loss_wire = 3 * 2 * (2 - 1) / 2 * (B * BASE["seq_len"] * 4)   # the loss's 3 all-reduces
    tp_activations = plain["tp/all_reduce"]["wire_bytes"] - loss_wire
    sp_activations = sp["tp/all_gather"]["wire_bytes"] + sp["tp/reduce_scatter"]["wire_bytes"]
    assert sp_activations == tp_activations > 0


# ---- tests of the test: planted bugs are caught ---------------------------------------------
def _buggy_worker(name, bug):
    """Run the comparison with one piece of the parallel model broken, then repair it."""
    saved = (layers_mod.copy_to_tensor_model_parallel_region,
             parallel_mod.copy_to_tensor_model_parallel_region, ParallelGPT.finalize_grads)
    if bug == "f is identity":        # forget the backward all-reduce of dL/dX before qkv/fc1
        layers_mod.copy_to_tensor_model_parallel_region = lambda x, group: x
        parallel_mod.copy_to_tensor_model_parallel_region = lambda x, group: x
    elif bug == "no finalize_grads":  # forget to sum the sequence-parallel gradients
        ParallelGPT.finalize_grads = lambda self: None
    try:
        pcfg, mcfg = _configs(name)
        return run_rank(pcfg, mcfg, 1)
    finally:
        (layers_mod.copy_to_tensor_model_parallel_region,
         parallel_mod.copy_to_tensor_model_parallel_region, ParallelGPT.finalize_grads) = saved


@pytest.mark.parametrize("name,bug,caught", [
    ("tp2-layernorm-gelu-learned-dropout", "f is identity", "dL/dX"),
    ("tp2-sp-layernorm-gelu-learned-dropout", "no finalize_grads", "grad layers.*.attn_norm.weight"),
])
def test_planted_bug_is_caught(run_ranks, name, bug, caught):
    rows = run_ranks(_buggy_worker, name, bug, world_size=2)[0]
    by_name = {r.quantity: r for r in rows}
    assert not by_name[caught].ok, f"{bug}: {caught} still matched ({by_name[caught].err:.2e})"
    assert by_name[caught].err > 100 * by_name[caught].tol
    assert by_name["loss"].ok and by_name["logits"].ok   # the forward pass is untouched by both


def _value_errors(attempts) -> list[str]:
    """The message of every attempt (a no-argument callable) that raised ValueError."""
    msgs = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def _errors_worker(tp):
    grid = build_grid(ParallelConfig(tp=tp))
    bad = (ModelConfig(**{**BASE, "n_kv_heads": 2}),
           ModelConfig(**{**BASE, "ffn_hidden": 6, "activation": "swiglu"}),  # 2*6 splits, 6 not
           ModelConfig(**{**BASE, "use_kernels": True}))                      # CPU ranks, no interpreter
    interpret = os.environ.pop("TRITON_INTERPRET", None)   # "no interpreter" under any setting
    try:
        return _value_errors(lambda cfg=cfg: ParallelGPT(cfg, grid) for cfg in bad)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def test_bad_configs_fail_early(run_ranks):
    msgs = run_ranks(_errors_worker, 4, world_size=4)[0]
    assert len(msgs) == 3
    assert "n_kv_heads=2 is not divisible by tp=4" in msgs[0]
    assert "ffn_hidden=6 is not divisible by tp=4" in msgs[1]
    assert "use_kernels" in msgs[2] and "TRITON_INTERPRET=1" in msgs[2]


def _out_of_range_worker():
    grid = build_grid(ParallelConfig(tp=2))
    model = ParallelGPT(ModelConfig(**BASE), grid)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    return _value_errors([lambda: model(tokens + BASE["vocab_size"], tokens),   # token too big
                          lambda: model(tokens, tokens - 1)])                   # negative target


def test_out_of_range_ids_are_refused(run_ranks):
    msgs = run_ranks(_out_of_range_worker, world_size=2)[0]
    assert len(msgs) == 2
    assert msgs[0].startswith("token ids must lie in [0, vocab_size=")
    assert msgs[1].startswith("target ids must lie in [0, vocab_size=")
