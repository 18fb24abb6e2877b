"""Mixed precision: the loss scaler's rule, an injected overflow skipped on every rank, 16-bit
training against a reference in the same precision, and a global gradient norm that counts
every parameter once.

16-bit tolerances (minitron.data_parallel.precision.tolerance16): gradients within C16 = 8 spacings eps16 of
the tensor's largest entry (bf16: 6.2e-2, fp16: 7.8e-3; measured at most 3.0 eps16), updated
16-bit weights within verify's update bar beyond 2 spacings of the stored 16-bit weight (both
sides update fp32 masters with the same gradients, so the masters agree to float32 rounding).
"""
import math

import pytest
import torch

from minitron.data_parallel import precision
from minitron.data_parallel import gathered_params, load_grads, wrap
from minitron.train.step import forward_backward
from minitron.grid import ParallelConfig, build_grid
from minitron.model import GPT, ModelConfig, ParallelGPT, gather_state_dict, shard_state_dict
from minitron.data_parallel.precision import LossScaler, clip_coefficient, grad_norm, optimizer_step
from minitron.verify import make_batch
from minitron.verify.checks import float32_tolerance, update_rows
from test_data_parallel import BASE, EPS, LR, SEED, _failures, dp_rank, reference_grads


def test_loss_scaler_backs_off_and_grows():
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    seen = []
    for overflow in [False, True, False, False, False, True, True, False]:
        s.update(overflow)
        seen.append(s.scale)
    # good; inf: halve; 3 good in a row: double; inf, inf: halve twice; good
    assert seen == [1024, 512, 512, 512, 1024, 512, 256, 256]
    floor = LossScaler(init_scale=2.0, min_scale=1.0)
    floor.update(True), floor.update(True)
    assert floor.scale == 1.0
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(growth_factor=1.0)


def overflow_rank():
    """fp16, dp=2, ZeRO-1: rank 1's gradient gets an inf at step 1; both ranks must skip."""
    grid = build_grid(ParallelConfig(dp=2))
    mcfg = ModelConfig(**BASE)
    model = ParallelGPT(mcfg, grid, seed=SEED).half()
    engine, opt = wrap(model, grid, 1, bucket_numel=4096, lr=LR, eps=EPS)
    scaler = LossScaler(init_scale=256.0, growth_interval=2)
    log = []
    for step in range(4):
        tokens, targets = make_batch(step, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
        engine.zero_grad()
        forward_backward(model, None, tokens, targets, step, engine=engine, loss_scale=scaler.scale)
        if step == 1 and grid.dp.rank == 1:
            engine.owned_grads()[0][0] = math.inf        # injected overflow, on one rank only
        before = torch.cat([t.clone() for t in engine.param_tensors()])
        out = optimizer_step(opt, engine, grid, scaler)
        after = torch.cat(engine.param_tensors())
        log.append((out["stepped"], out["scale"], scaler.scale, bool(torch.equal(before, after))))
    return log


def test_injected_overflow_is_skipped_everywhere(run_ranks):
    logs = run_ranks(overflow_rank, world_size=2)
    assert logs[0] == logs[1]
    # (stepped, scale used, scale after, weights unchanged)
    assert logs[0] == [(True, 256.0, 256.0, False), (False, 256.0, 128.0, True),
                       (True, 128.0, 128.0, False), (True, 128.0, 256.0, False)]


SIXTEEN = {
    "bf16-zero1-dp2": (ParallelConfig(dp=2), 1, torch.bfloat16, 1.0, 2),
    "fp16-zero2-dp2-scaled": (ParallelConfig(dp=2), 2, torch.float16, 1024.0, 2),
    "bf16-zero1-dp2-tp2-sp": (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 1, torch.bfloat16, 1.0, 4),
}


@pytest.mark.parametrize("name", list(SIXTEEN))
def test_16bit_matches_a_reference_in_the_same_precision(run_ranks, name):
    pcfg, stage, dtype, scale, world = SIXTEEN[name]
    mcfg = ModelConfig(**BASE, dropout=0.1)
    rows, _ = run_ranks(dp_rank, pcfg, mcfg, stage, 2, 1, 4, 4096, None, dtype, scale,
                        world_size=world)[0]
    assert not _failures(rows), "\n".join(_failures(rows))
    worst = max(r.err for r in rows if r.quantity.startswith("grad"))
    assert 0 < worst <= 4 * torch.finfo(dtype).eps, worst       # measured <= 3.0: C16 = 8 has margin


# ---- the global gradient norm --------------------------------------------------------------
def norm_rank(pcfg, stage, plant=None, max_norm=0.5):
    grid = build_grid(pcfg)
    mcfg = ModelConfig(**BASE)
    ref = GPT(mcfg, SEED)
    model = ParallelGPT.from_reference(ref, grid)
    engine, opt = wrap(model, grid, stage, bucket_numel=4096, lr=LR, eps=EPS)
    if plant == "count_replicas_everywhere":
        precision._tp_replicated = lambda model, grid: set()
    tokens, targets = make_batch(0, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
    engine.zero_grad()
    forward_backward(model, None, tokens, targets, 0, engine=engine)
    norm = grad_norm(engine, grid)
    ref_grads = {n: g.clone() for n, g in reference_grads(ref, tokens, targets, 0).items()}
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    # Clipping inside the step: on the reference's gradients, as verify steps.
    load_grads(engine, shard_state_dict(ref_grads, mcfg, grid))
    old = gather_state_dict(gathered_params(engine), mcfg, grid)
    out = optimizer_step(opt, engine, grid, max_norm=max_norm)
    new = gather_state_dict(gathered_params(engine), mcfg, grid)
    ref_old = {n: p.detach().clone() for n, p in ref.named_parameters()}
    torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS).step()   # grads already clipped in place
    rows = update_rows(0, new, old, {n: p.detach() for n, p in ref.named_parameters()}, ref_old)
    return norm, out["norm"], ref_norm, _failures(rows), float32_tolerance(mcfg, 4, mcfg.seq_len)


NORM_CASES = {
    "dp2-tp2-sp-zero1": ParallelConfig(dp=2, tp=2, sequence_parallel=True),
    "dp2-tp2-plain": ParallelConfig(dp=2, tp=2),
}


@pytest.mark.parametrize("name, stage", [("dp2-tp2-sp-zero1", 1), ("dp2-tp2-plain", 0)])
def test_grad_norm_counts_every_parameter_once(run_ranks, name, stage):
    for norm, clip_norm, ref_norm, bad_updates, tol in run_ranks(norm_rank, NORM_CASES[name], stage,
                                                                  world_size=4):
        assert abs(norm - ref_norm) <= tol * ref_norm, (norm, ref_norm)
        assert abs(clip_norm - ref_norm) <= tol * ref_norm
        assert clip_coefficient(ref_norm, 0.5) < 1                 # the clip really acted
        assert not bad_updates, "\n".join(bad_updates)


def test_planted_double_count_is_caught(run_ranks):
    norm, _, ref_norm, _, tol = run_ranks(norm_rank, NORM_CASES["dp2-tp2-sp-zero1"], 1,
                                          "count_replicas_everywhere", world_size=4)[0]
    assert abs(norm - ref_norm) > 100 * tol * ref_norm
