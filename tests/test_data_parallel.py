"""DataParallel against the reference on the whole global batch, against torch's DDP, and its
buckets: one message per bucket per step, started while backward still runs.

`dp_rank` is the per-rank body (test_zero.py uses it too): every rank builds the reference GPT,
its ParallelGPT shard and the engine; runs its rows of the global batch in micro-batches;
compares the data-parallel-reduced gradients, gathered over tp, with the reference's on the
whole batch (minitron.verify.checks' float32 tolerance); then, as minitron.verify does, loads
the reference's gradients into the engine and compares the updated weights with
torch.optim.AdamW's (update tolerance). Every rank runs the (tiny) reference itself.
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from minitron.runtime import comm, comm_async
from minitron.data_parallel import (DataParallel, gathered_grads, gathered_params, load_grads,
                                    wrap)
from minitron.train.step import forward_backward, replica_rows
from minitron.grid import ParallelConfig, build_grid
from minitron.model import GPT, ModelConfig, ParallelGPT, gather_state_dict, shard_state_dict
from minitron.model.convert import rules
from minitron.data_parallel.precision import MasterWeightsAdamW, tolerance16
from minitron.verify import make_batch
from minitron.verify.checks import float32_tolerance, grad_rows, update_rows

BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4)
SEED, LR, EPS = 0, 1e-3, 1e-6


class _Skipped:
    """A planted bug: a bucket whose collective never happens (it 'completes' at once)."""
    done = True

    def __init__(self, t):
        self.result = t

    def wait(self):
        return self.result

    def poll(self):                     # DataParallel's hooks ask whether it has finished
        return True


def plant_bug(engine, plant):
    if plant == "skip_bucket":          # bucket 1's gradients are never averaged
        gb = engine.buffers[0]
        launch = gb.launch

        def skipping(b):
            launch(b)
            if b == 1:
                gb.pending[b].wait()
                bucket = gb.layout.buckets[b]
                data = gb.grads_flat[bucket.start:bucket.end]
                data.mul_(gb.group.size)  # undo the 1/n: this rank's own gradient only
                gb.pending[b] = _Skipped(data)
        gb.launch = skipping
    elif plant == "no_divide":          # sum instead of mean
        for gb in getattr(engine, "buffers", [engine]):
            gb.scale = 1.0
    elif plant == "skip_all_gather":    # ZeRO: each rank keeps only its own shard's update
        engine.after_step = lambda: None
    elif plant is not None:
        raise ValueError(plant)


def reference_grads(ref, tokens, targets, step_seed, loss_scale=1.0):
    """The reference's gradients on the whole batch (of the loss times loss_scale)."""
    ref.zero_grad(set_to_none=True)
    ref.rng.reset(step_seed)
    _, loss = ref(tokens, targets)
    (loss * loss_scale).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def dp_rank(pcfg, mcfg, zero_stage=0, steps=2, micro=1, batch=4, bucket_numel=None, plant=None,
            dtype=torch.float32, loss_scale=1.0):
    """Returns (rows on rank 0 else None, per-rank info: comm counts, events).

    In 16-bit the reference is the same model in the same dtype stepped by MasterWeightsAdamW
    (fp32 masters, torch's AdamW), and gradients are held to precision.tolerance16."""
    grid = build_grid(pcfg)
    ref = GPT(mcfg, SEED).to(dtype)
    model = ParallelGPT.from_reference(ref, grid)
    engine, opt = wrap(model, grid, zero_stage, bucket_numel, lr=LR, eps=EPS)
    plant_bug(engine, plant)
    seq = mcfg.seq_len
    if dtype == torch.float32:
        ref_opt, tol = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS), float32_tolerance(mcfg, batch, seq)
    else:
        ref_opt, tol = MasterWeightsAdamW(ref, lr=LR, eps=EPS), tolerance16(dtype)
    rows, info = [], {"calls": [], "wire": [], "events": []}
    for step in range(steps):
        tokens, targets = make_batch(step, SEED, batch, seq, mcfg.vocab_size)
        step_seed = SEED * 1000 + step
        engine.zero_grad()
        with comm.counting() as c:                         # its rows, micro-batches, finish_grad_sync
            forward_backward(model, None, tokens, targets, step_seed, engine=engine,
                             microbatches=micro, loss_scale=loss_scale)
        info["calls"].append({k: v["calls"] for k, v in c.as_dict().items()
                              if k.startswith("dense_dp/")})   # not the loss's mean over ep_dp
        info["wire"].append(c.wire_bytes(group="dense_dp"))
        info["events"].append(list(getattr(engine, "events", [])))
        grads = gather_state_dict(gathered_grads(engine), mcfg, grid)
        ref_grads = reference_grads(ref, tokens, targets, step_seed, loss_scale)
        rows += grad_rows(step, grads, ref_grads, tol)
        # The step on its own: both optimizers step on the reference's gradients.
        load_grads(engine, shard_state_dict(ref_grads, mcfg, grid))
        old = gather_state_dict(gathered_params(engine), mcfg, grid)
        with comm.counting() as c:
            opt.step(grad_scale=loss_scale)
        info["wire"][-1] += c.wire_bytes(group="dense_dp")
        new = gather_state_dict(gathered_params(engine), mcfg, grid)
        ref_old = {n: p.detach().clone() for n, p in ref.named_parameters()}
        ref_opt.step(**({} if dtype == torch.float32 else {"grad_scale": loss_scale}))
        rows += update_rows(step, new, old, {n: p.detach() for n, p in ref.named_parameters()}, ref_old)
    return (rows if grid.rank == 0 else None), info


def _failures(rows):
    return [f"step {r.step} {r.quantity}: {r.err:.2e} > {r.tol:.0e}" for r in rows if not r.ok]


CASES = {
    "dp2-dropout": (ParallelConfig(dp=2), dict(dropout=0.1), 2),
    "dp2-tp2-sp-dropout": (ParallelConfig(dp=2, tp=2, sequence_parallel=True),
                           dict(dropout=0.1, norm="rmsnorm", activation="swiglu"), 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dp_matches_reference_on_the_whole_batch(run_ranks, name):
    pcfg, opts, world = CASES[name]
    mcfg = ModelConfig(**{**BASE, **opts})
    rows, info = run_ranks(dp_rank, pcfg, mcfg, 0, 2, 2, 4, 4096, world_size=world)[0]
    assert not _failures(rows), "\n".join(_failures(rows))
    assert {r.quantity for r in rows if r.quantity.startswith("grad")}  # every tensor compared
    # Two micro-batches, yet every bucket was sent once: in the last micro-batch only.
    calls = info["calls"][0]
    n_buckets = calls["dense_dp/all_reduce"]
    assert n_buckets >= 3, calls
    events = info["events"][0]
    first_launch = next(i for i, e in enumerate(events) if e[0] == "launch")
    grads_after = [e for e in events[first_launch:] if e[0] == "grad"]
    assert grads_after, "no bucket was started before the last gradient was ready: no overlap"


def test_grad_accumulation_communicates_once(run_ranks):
    mcfg = ModelConfig(**BASE)
    rows, info = run_ranks(dp_rank, ParallelConfig(dp=2), mcfg, 0, 1, 4, 8, None, world_size=2)[0]
    assert not _failures(rows), "\n".join(_failures(rows))
    assert info["calls"][0] == {"dense_dp/all_reduce": 1}    # 4 micro-batches, one bucket, one call
    events = info["events"][0]
    grads = [e for e in events if e[0] == "grad"]
    assert len(grads) == len(rules(mcfg))   # hooks counted the last micro-batch's only


@pytest.mark.parametrize("plant", ["skip_bucket", "no_divide"])
def test_planted_bug_is_caught(run_ranks, plant):
    mcfg = ModelConfig(**BASE)
    rows, _ = run_ranks(dp_rank, ParallelConfig(dp=2), mcfg, 0, 1, 1, 4, 4096, plant,
                        world_size=2)[0]
    bad = [r for r in rows if not r.ok and r.quantity.startswith("grad")]
    assert bad, f"planted {plant} went unnoticed"


# ---- torch's DistributedDataParallel as a peer -------------------------------------------------
def ddp_peer_rank(mcfg, steps=2):
    grid = build_grid(ParallelConfig(dp=2))
    mine, theirs = GPT(mcfg, SEED), GPT(mcfg, SEED)
    engine = DataParallel(mine, grid, bucket_numel=4096)
    ddp = DistributedDataParallel(theirs, bucket_cap_mb=1)
    diffs = []
    for step in range(steps):
        tokens, targets = make_batch(step, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
        rows = slice(2 * grid.dp.rank, 2 * grid.dp.rank + 2)
        engine.zero_grad()
        theirs.zero_grad(set_to_none=True)
        mine(tokens[rows], targets[rows])[1].backward()
        engine.finish_grad_sync()
        ddp(tokens[rows], targets[rows])[1].backward()
        for (n, p), q in zip(mine.named_parameters(), theirs.parameters()):
            diffs.append((n, (p.grad - q.grad).abs().max().item(), q.grad.abs().max().item()))
        with torch.no_grad():          # the same (arbitrary) update on both, to move on
            for p, q in zip(mine.parameters(), theirs.parameters()):
                p.sub_(0.1 * p.grad.sign())
                q.sub_(0.1 * q.grad.sign())
    return diffs


def test_grads_equal_torch_ddp(run_ranks):
    mcfg = ModelConfig(**BASE)
    tol = float32_tolerance(mcfg, 4, mcfg.seq_len)
    for diffs in run_ranks(ddp_peer_rank, mcfg, world_size=2):
        bad = [f"{n}: {d:.2e} (scale {s:.1e})" for n, d, s in diffs if d > tol * s]
        assert not bad, "\n".join(bad)


# ---- comm_async on its own ---------------------------------------------------------------------
def async_rank():
    grid = build_grid(ParallelConfig(dp=2))
    r = grid.dp.rank
    with comm.counting() as c:
        ar = comm_async.all_reduce(torch.full((4,), float(r + 1)), grid.dp)
        rs = comm_async.reduce_scatter(torch.arange(4.0) * (r + 1), grid.dp)
        ag = comm_async.all_gather(torch.full((2,), float(r)), grid.dp)
        out = [ar.wait().tolist(), rs.wait().tolist(), ag.wait().tolist()]
    return out, c.calls(), c.wire_bytes()


def test_async_collectives(run_ranks):
    res = run_ranks(async_rank, world_size=2)
    assert res[0][0] == [[3.0] * 4, [0.0, 3.0], [0.0, 0.0, 1.0, 1.0]]
    assert res[1][0][1] == [6.0, 9.0]
    assert res[0][1] == 3 and res[0][2] == 2 * 0.5 * 16 + 0.5 * 16 + 0.5 * 16


# ---- a pipeline's tied embedding: summed over the embedding group, then averaged over dp ----
def shared_embedding_rank(stage):
    grid = build_grid(ParallelConfig(dp=2, pp=2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.shared_embedding = True    # as if stage 0's and the last stage's copies
    x = torch.arange(12.0).view(3, 4) * (grid.rank + 1)
    model(x).pow(2).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = DataParallel(model, grid, bucket_numel=8, zero_stage=stage)
    engine.zero_grad()
    model(x).pow(2).sum().backward()
    engine.finish_grad_sync()
    return local, gathered_grads(engine)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tied_embedding_summed_over_stages_then_averaged(run_ranks, stage):
    out = run_ranks(shared_embedding_rank, stage, world_size=4)
    locals_ = [o[0] for o in out]
    for rank, (_, got) in enumerate(out):
        dp_peers = [rank ^ 1]                    # dense_dp groups [0, 1], [2, 3]
        for name, g in got.items():
            if name == "0.weight":               # all four: both stages, both replicas
                want = sum(loc[name] for loc in locals_) / 2
            else:
                want = (locals_[rank][name] + locals_[dp_peers[0]][name]) / 2
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("exact", [False, True])      # polled stamps, or gloo's thread's
def test_overlap_measured(run_ranks, exact):
    mcfg = ModelConfig(**BASE)
    fractions = run_ranks(overlap_rank, mcfg, exact, world_size=2)
    for n_events, fraction, ordered in fractions:
        assert n_events >= 3 and ordered and 0.0 <= fraction <= 1.0
        print(f"share of all-reduce time hidden behind backward: {fraction:.0%}")


def overlap_rank(mcfg, exact):
    grid = build_grid(ParallelConfig(dp=2))
    model = ParallelGPT(mcfg, grid, seed=SEED)
    engine = DataParallel(model, grid, bucket_numel=4096)
    engine.exact_timeline = exact
    tokens, targets = make_batch(0, SEED, 8, mcfg.seq_len, mcfg.vocab_size)
    engine.zero_grad()
    forward_backward(model, None, tokens, targets, 0, engine=engine)
    events = engine.comm_events()
    ordered = all(e.start <= e.end for e in events) and [e.stage for e in events] == sorted(e.stage for e in events)
    return len(events), engine.hidden_fraction(), ordered


# ---- expert parameters: summed over dp_cp, divided by dense_dp's size ----------------------
def expert_rank():
    grid = build_grid(ParallelConfig(dp=2, ep=2))     # dense_dp [0..3], dp_cp [0, 2], [1, 3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight.allreduce = False                  # as Megatron marks expert weights
    x = torch.arange(12.0).view(3, 4) * (grid.rank + 1)
    model(x).pow(2).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = DataParallel(model, grid, zero_stage=1)
    engine.zero_grad()
    model(x).pow(2).sum().backward()
    engine.finish_grad_sync()
    return local, gathered_grads(engine), sorted(g.group.name for g in engine.buffers)


def test_expert_grads_summed_over_dp_cp_divided_by_dense_dp(run_ranks):
    out = run_ranks(expert_rank, world_size=4)
    locals_ = [o[0] for o in out]
    for rank, (_, got, groups) in enumerate(out):
        assert groups == ["dense_dp", "dp_cp"]
        for name, g in got.items():
            peers = [rank % 2, rank % 2 + 2] if name == "1.weight" else range(4)
            want = sum(locals_[r][name] for r in peers) / 4
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)


def test_mixed_dtypes_refused(run_ranks):
    assert "one dtype" in run_ranks(mixed_dtype_rank, world_size=2)[0]


def mixed_dtype_rank():
    grid = build_grid(ParallelConfig(dp=2))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    try:
        DataParallel(model, grid)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_replica_rows_split_over_dp_and_ep_not_cp():
    from types import SimpleNamespace
    cfg = ParallelConfig(dp=2, ep=2, cp=2)
    got = [replica_rows(8, SimpleNamespace(config=cfg, coords=cfg.coords(r))).tolist()
           for r in range(8)]                # rank = cp + 2 * (ep + 2 * dp)
    assert got == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    with pytest.raises(ValueError, match="multiple of 4"):
        replica_rows(6, SimpleNamespace(config=cfg, coords=cfg.coords(0)))


def test_replicas_micro_batch_m_is_a_slice_of_the_batchs():
    """Megatron's sampler: the step's micro-batch m is rows [m*B/M, (m+1)*B/M) whatever the
    layout, each replica holding one slice of it (here 2 micro-batches of 4 rows, dp x ep = 4)."""
    from types import SimpleNamespace
    cfg = ParallelConfig(dp=2, ep=2)
    got = [replica_rows(8, SimpleNamespace(config=cfg, coords=cfg.coords(r)), 2).tolist()
           for r in range(4)]
    assert got == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="multiple of 8"):
        replica_rows(4, SimpleNamespace(config=cfg, coords=cfg.coords(0)), 2)


def unused_param_rank(stage, plant):
    """A parameter used in step 1 and not in step 2 must send zeros in step 2, not step 1's
    gradient left in its view (zero_grad leaves .grad None; buffer.fill_missing zeroes it)."""
    grid = build_grid(ParallelConfig(tp=1, dp=2))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    engine = DataParallel(model, grid, bucket_numel=None, zero_stage=stage)
    if plant:                           # the bug: the stale view is sent as it is
        for gb in engine.buffers:
            gb.fill_missing = lambda b: None
    x = torch.ones(2, 4) * (grid.dp.rank + 1)
    grads = []
    for use_b in (True, False):
        engine.zero_grad()
        y = model["a"](x)
        if use_b:
            y = model["b"](y)
        y.sum().backward()
        engine.finish_grad_sync()
        grads.append([t.clone() for _, t in engine.grad_pieces(model["b"].weight)])
    return grads


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("plant", [False, True])
def test_a_parameter_without_a_gradient_sends_zeros(run_ranks, stage, plant):
    ranks = run_ranks(unused_param_rank, stage, plant, world_size=2)   # ZeRO-1: each its pieces
    step1 = [g for r in ranks for g in r[0]]
    step2 = [g for r in ranks for g in r[1]]
    assert sum(g.numel() for g in step2) == 16 * (2 if stage == 0 else 1)   # whole, per copy
    assert any(g.abs().sum() > 0 for g in step1)               # it was used in step 1
    assert all(torch.equal(g, torch.zeros_like(g)) for g in step2) != plant


def test_poll_stamps_the_finish_only_once_the_work_is_done():
    class Work:                       # a collective in flight that the test completes by hand
        completed = False

        def is_completed(self):
            return self.completed

        def wait(self):
            self.completed = True
    work = Work()
    pending = comm_async.Pending("all_reduce", comm.single_group(), work, None, stamp=False)
    assert not pending.poll() and pending.finished is None          # not done: no stamp
    work.completed = True
    assert pending.poll() and pending.started <= pending.finished
    first = pending.finished
    pending.wait()
    assert pending.finished == first                                # the first sighting stays
