"""ModelConfig.dropout_rng: "exact" (the full mask, sliced) and "per_rank" (Megatron's seeding).

Megatron's rule (megatron/core/tensor_parallel/random.py, model_parallel_cuda_manual_seed):
dropout on activations split across the TP group draws from a generator seeded
seed + 2718 + tp_rank, dropout on replicated activations from one seeded `seed`. The
masks expected here are regenerated from that rule alone, draw by draw, and compared with
what each rank of a real ParallelGPT drew in a training step.
"""
import math

import pytest
import torch

from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig, ParallelGPT
from minitron.tensor_parallel.random import (REPLICATED, TENSOR_PARALLEL, DropoutRNG,
                                             PerRankDropoutRNG, make_dropout_rng)
from minitron.train.step import parallel_step
from minitron.verify import make_batch, run_rank

TP, B, STEP_SEED = 2, 2, 7
# s*s*heads/tp > s*h, so the attention mask is the largest draw in both modes.
MODEL = dict(vocab_size=64, seq_len=32, hidden=32, n_layers=2, n_heads=4, dropout=0.1)


def _cfg(mode: str, **changes) -> ModelConfig:
    return ModelConfig(**{**MODEL, "dropout_rng": mode, **changes})


# ---- what Megatron's rule draws, computed without minitron's RNG -----------------------------
def megatron_draws(cfg: ModelConfig, tp: int, sp: bool, b: int, s: int):
    """(region, shape) of every mask one rank draws in a forward, in order."""
    act = (TENSOR_PARALLEL, (b, s // tp, cfg.hidden)) if sp else (REPLICATED, (b, s, cfg.hidden))
    attention = (TENSOR_PARALLEL, (b, cfg.n_heads // tp, s, s))
    return [act] + [attention, act, act] * cfg.n_layers    # embedding, then per layer


def megatron_violations(ranks: list[dict], cfg: ModelConfig, sp: bool, seed: int) -> list[str]:
    """Every way the ranks' recorded masks differ from Megatron's per-rank seeding."""
    tp, s = len(ranks), cfg.seq_len
    expected = megatron_draws(cfg, tp, sp, B, s)
    sizes = [torch.Size(shape).numel() for _, shape in expected]
    bad = []
    for r, rank in enumerate(ranks):
        streams = {REPLICATED: torch.Generator().manual_seed(seed),
                   TENSOR_PARALLEL: torch.Generator().manual_seed(seed + 2718 + r)}
        got = [(region, shape) for region, shape, _ in rank["draws"]]
        if got != expected:
            bad.append(f"rank {r} drew {got}, Megatron's rule draws {expected}")
            continue
        for k, (region, shape, mask) in enumerate(rank["draws"]):
            if not torch.equal(mask, torch.rand(shape, generator=streams[region]) >= cfg.dropout):
                bad.append(f"rank {r} draw {k} ({region}): not the mask of Megatron's seed")
        if (rank["drawn"], rank["largest"]) != (sum(sizes), max(sizes)):
            bad.append(f"rank {r} drew {rank['drawn']} numbers, largest {rank['largest']}; "
                       f"the local masks are {sum(sizes)}, largest {max(sizes)}")
    if any(b.endswith(f"draws {expected}") for b in bad):
        return bad                    # the shapes differ: masks cannot be compared across ranks
    for k, (region, _) in enumerate(expected):
        for r in range(1, tp):
            same = torch.equal(ranks[0]["draws"][k][2], ranks[r]["draws"][k][2])
            if region == TENSOR_PARALLEL and same:
                bad.append(f"draw {k}: tensor-parallel masks identical on ranks 0 and {r}")
            if region == REPLICATED and not same:
                bad.append(f"draw {k}: replicated masks differ on ranks 0 and {r}")
    return bad


# ---- one training step on real ranks, every mask recorded -----------------------------------
class _SameSeedEveryRank(PerRankDropoutRNG):
    """A planted bug: the tp_rank offset forgotten, so every rank draws the same 'own' masks."""

    def stream_seed(self, stream):
        return self._current_seed + (2718 if stream == TENSOR_PARALLEL else 0)


def _record_step(mode: str, sp: bool, plant: bool = False):
    grid = build_grid(ParallelConfig(tp=TP, sequence_parallel=sp))
    cfg = _cfg(mode)
    model = ParallelGPT(cfg, grid, seed=0)
    if plant:
        model.rng = _SameSeedEveryRank(0, tp_rank=grid.tp_rank)
    draws, keep_mask = [], model.rng.keep_mask

    def recording(shape, p, device=None, region=REPLICATED):
        mask = keep_mask(shape, p, device=device, region=region)
        draws.append((region, tuple(shape), mask.clone()))
        return mask

    model.rng.keep_mask = recording
    tokens, targets = make_batch(0, 0, B, cfg.seq_len, cfg.vocab_size)
    _, _, loss = parallel_step(model, tokens, targets, STEP_SEED)
    replicated = {n: p.grad.clone() for n, p in model.named_parameters()
                  if "norm" in n or n == "embedding.position.weight"}
    return dict(draws=draws, drawn=model.rng.elements_drawn, largest=model.rng.largest_draw,
                loss=loss.item(), replicated_grads=replicated)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_per_rank_masks_follow_megatrons_rule(run_ranks, sp):
    ranks = run_ranks(_record_step, "per_rank", sp, world_size=TP)
    assert megatron_violations(ranks, _cfg("per_rank"), sp, STEP_SEED) == []
    assert all(math.isfinite(r["loss"]) for r in ranks)         # the step ran to a finite loss
    # Replicated activations got identical masks, so replicated weights stay replicas.
    for name, grad in ranks[0]["replicated_grads"].items():
        assert torch.equal(grad, ranks[1]["replicated_grads"][name]), name


def test_per_rank_never_draws_the_full_attention_mask(run_ranks):
    cfg = _cfg("per_rank")
    full = B * cfg.n_heads * cfg.seq_len ** 2
    per_rank = run_ranks(_record_step, "per_rank", False, world_size=TP)
    exact = run_ranks(_record_step, "exact", False, world_size=TP)
    assert [r["largest"] for r in per_rank] == [full // TP] * TP
    assert [r["largest"] for r in exact] == [full] * TP
    act = B * cfg.seq_len * cfg.hidden           # embedding and residual masks: replicated
    assert [r["drawn"] for r in per_rank] == [act + cfg.n_layers * (full // TP + 2 * act)] * TP
    assert [r["drawn"] for r in exact] == [act + cfg.n_layers * (full + 2 * act)] * TP


def test_the_check_catches_a_forgotten_rank_offset_and_the_exact_mode(run_ranks):
    planted = run_ranks(_record_step, "per_rank", False, True, world_size=TP)
    bad = megatron_violations(planted, _cfg("per_rank"), False, STEP_SEED)
    assert "rank 1 draw 1 (tensor_parallel): not the mask of Megatron's seed" in bad
    assert "draw 1: tensor-parallel masks identical on ranks 0 and 1" in bad
    assert not any(b.startswith("rank 0") for b in bad)     # rank 0's offset is 0 anyway
    assert not any("replicated" in b for b in bad)          # the replicated stream is right
    exact = run_ranks(_record_step, "exact", False, world_size=TP)
    bad = megatron_violations(exact, _cfg("exact"), False, STEP_SEED)
    assert bad[0].startswith("rank 0 drew [('replicated', (2, 32, 32)), "
                             "('replicated', (2, 4, 32, 32))"), bad


# ---- with nothing to drop, the modes are the same computation --------------------------------
def _logits(mode: str, dropout: float, training: bool):
    grid = build_grid(ParallelConfig(tp=TP, sequence_parallel=True))
    model = ParallelGPT(_cfg(mode, dropout=dropout), grid, seed=0).train(training)
    model.rng.reset(STEP_SEED)
    tokens, _ = make_batch(0, 0, B, MODEL["seq_len"], MODEL["vocab_size"])
    return model(tokens).detach(), model.rng.elements_drawn


def test_per_rank_equals_exact_without_dropout_and_in_eval(run_ranks):
    for dropout, training in [(0.0, True), (0.1, False)]:
        exact = run_ranks(_logits, "exact", dropout, training, world_size=TP)
        per_rank = run_ranks(_logits, "per_rank", dropout, training, world_size=TP)
        for (a, drawn_a), (b, drawn_b) in zip(exact, per_rank):
            assert torch.equal(a, b) and drawn_a == drawn_b == 0
    exact = run_ranks(_logits, "exact", 0.1, True, world_size=TP)
    per_rank = run_ranks(_logits, "per_rank", 0.1, True, world_size=TP)
    assert not torch.equal(exact[0][0], per_rank[0][0])   # with dropout the masks differ


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_per_rank_without_dropout_matches_the_reference(run_ranks, sp):
    rows = run_ranks(run_rank, ParallelConfig(tp=TP, sequence_parallel=sp),
                     _cfg("per_rank", dropout=0.0, seq_len=8), 2, world_size=TP)[0]
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


# ---- one process: the streams and the bad inputs --------------------------------------------
def test_streams_are_seeded_megatrons_way_and_restart_on_reset():
    rng = PerRankDropoutRNG(5, tp_rank=3)
    for _ in range(2):
        tp_mask = rng.keep_mask((4, 4), 0.5, region=TENSOR_PARALLEL)
        rep_mask = rng.keep_mask((4, 4), 0.5, region=REPLICATED)
        assert torch.equal(tp_mask, torch.rand(4, 4, generator=torch.Generator().manual_seed(5 + 2718 + 3)) >= 0.5)
        assert torch.equal(rep_mask, torch.rand(4, 4, generator=torch.Generator().manual_seed(5)) >= 0.5)
        rng.reset()


def test_exact_masks_are_keyed_by_layer_call_and_global_row():
    """Where a mask sits decides it, not what was drawn before: a pipeline stage, a micro-batch
    or a data-parallel rank that says where it is draws exactly the reference's rows."""
    whole = DropoutRNG(5)
    whole.reset(3)
    whole.at_layer(2)
    first, second = whole.keep_mask((4, 6), 0.5), whole.keep_mask((4, 6), 0.5)
    assert not torch.equal(first, second)                    # each call of a layer has its own
    part = DropoutRNG(5)
    part.reset(3)
    part.keep_mask((9, 9), 0.5, region=TENSOR_PARALLEL)     # draws elsewhere change nothing
    part.at_layer(2)
    part.rows_from(2)                                        # rows 2 and 3 of the batch only
    assert torch.equal(part.keep_mask((2, 6), 0.5), first[2:])
    assert torch.equal(part.keep_mask((2, 6), 0.5), second[2:])
    part.reset(4)                                            # another step: other masks
    part.at_layer(2)
    assert not torch.equal(part.keep_mask((4, 6), 0.5), first)


def test_exact_mode_slices_the_full_mask():
    x = torch.ones(2, 2, 4, 4)
    y = DropoutRNG(9).dropout(x, 0.5, True, index=(slice(None), slice(1, 3)), full_shape=(2, 6, 4, 4))
    full = DropoutRNG(9).keep_mask((2, 6, 4, 4), 0.5)
    assert torch.equal(y, full[:, 1:3].float() * 2.0)


def test_bad_options_say_what_to_change():
    with pytest.raises(ValueError, match=r"dropout_rng='megatron': choose one of \('exact', 'per_rank'\)"):
        ModelConfig(dropout_rng="megatron")
    with pytest.raises(ValueError, match=r"dropout_rng='megatron': choose one of"):
        make_dropout_rng("megatron", 0)
    with pytest.raises(ValueError, match="tp_rank must be a non-negative integer, got -1"):
        PerRankDropoutRNG(0, tp_rank=-1)
    with pytest.raises(ValueError, match="region must be 'replicated' or 'tensor_parallel'"):
        DropoutRNG(0).keep_mask((2,), 0.5, region="tp")


def test_micro_batches_draw_the_whole_batchs_masks():
    """The reference GPT run on two halves of a batch (rows_from) gives the whole batch's logits."""
    from minitron.model import GPT
    model = GPT(_cfg("exact", seq_len=8), seed=0).train()
    tokens, _ = make_batch(0, 0, 4, 8, MODEL["vocab_size"])
    model.rng.reset(STEP_SEED)
    whole = model(tokens)
    halves = []
    for first in (0, 2):
        model.rng.reset(STEP_SEED)
        model.rng.rows_from(first)
        halves.append(model(tokens[first:first + 2]))
    assert torch.allclose(torch.cat(halves), whole, rtol=0, atol=1e-6)
    model.rng.reset(STEP_SEED)            # the test of the test: forgetting rows_from differs
    assert not torch.allclose(model(tokens[2:]), whole[2:], atol=1e-3)
