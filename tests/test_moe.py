"""The expert-parallel MoE layer against the single-device MoE (minitron/moe/).

Every rank feeds its own tokens (rows split over dense_dp, the sequence over tp under SP)
through ParallelMoE holding its experts; the outputs, dL/dX, the router's and every expert's
gradient (reduced and gathered as data-parallel code would) and the pairs a capacity factor
drops must equal the reference MoE run on the whole batch. Tolerance: 1e-5 relative (float32,
sums of at most a few hundred terms; measured errors are ~1e-7). Bytes through comm equal the
formula exactly; planted dispatch bugs are caught.
"""
import dataclasses

import pytest
import torch

from minitron.runtime import comm
from minitron.grid import ParallelConfig, build_grid
from minitron.config import ModelConfig
from minitron.model.reference import GPT, init_weights
from minitron.moe import MoE, ParallelMoE, imbalance, route
from minitron.model.splits import validate_model
from minitron.moe.experts import TP_DIM, shard_moe_state_dict
from minitron.moe.router import apply_capacity, capacity, update_expert_bias
from minitron.verify.compare import rel_err
from minitron.verify.plants_moe import plant_dispatch

TOL = 1e-5
CFG = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, n_experts=4,
                  topk=2, z_loss_coeff=1e-3)


def _data(cfg, batch):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, cfg.seq_len, cfg.hidden, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def _reference(cfg):
    ref = MoE(cfg)
    init_weights(ref, cfg, seed=1)
    with torch.no_grad():            # a router with some opinion: init_std alone is near uniform
        ref.router.weight.mul_(20)
    return ref


def _my_slice(grid, batch, seq):
    rows = batch // grid.dense_dp.size
    r0 = grid.dense_dp.rank * rows
    s_local = seq // grid.tp.size if grid.sequence_parallel else seq
    s0 = grid.tp.rank * s_local if grid.sequence_parallel else 0
    return (slice(r0, r0 + rows), slice(s0, s0 + s_local))


def _gather_expert_grad(g, key, grid):
    dim = TP_DIM[key]
    if dim is not None:
        g = comm.all_gather(g.contiguous(), grid.tp, dim=dim)
    return comm.all_gather(g.contiguous(), grid.ep, dim=0)


def layer_errors(pcfg, cfg, dispatcher="alltoall", plant=None, batch=4):
    """Run on every rank: the worst relative errors of ParallelMoE against MoE."""
    grid = build_grid(pcfg)
    ref = _reference(cfg)
    x, gy = _data(cfg, batch)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    ((yr * gy).sum() + ref.aux_loss).backward()

    layer = ParallelMoE(cfg, grid, dispatcher)
    layer.load_state_dict(shard_moe_state_dict(ref.state_dict(), grid.ep.size, grid.ep.rank,
                                               grid.tp.size, grid.tp.rank))
    if plant is not None:
        plant_dispatch(layer, plant)
    idx = _my_slice(grid, batch, cfg.seq_len)
    xp = x[idx].clone().requires_grad_()
    yp = layer(xp)
    replicas = grid.dense_dp.size
    ((yp * gy[idx]).sum() + layer.aux_loss / replicas).backward()

    # what data-parallel code and finalize_grads do: dense over dense_dp (+ tp under SP), experts
    # over dp_cp (+ tp for the SP-marked fc2 bias)
    router = comm.all_reduce(layer.router.weight.grad.clone(), grid.dense_dp)
    if grid.sequence_parallel:
        router = comm.all_reduce(router, grid.tp)
    errs = {"y": rel_err(yp, yr[idx]), "dx": rel_err(xp.grad, xr.grad[idx]),
            "router": rel_err(router, ref.router.weight.grad)}
    for key, p in layer.experts.named_parameters():
        g = comm.all_reduce(p.grad.clone(), grid.dp_cp)
        if getattr(p, "sequence_parallel", False):
            g = comm.all_reduce(g, grid.tp)
        errs[key] = rel_err(_gather_expert_grad(g, key, grid), ref.experts.get_parameter(key).grad)
    aux = comm.all_reduce(layer.aux_loss.detach().clone(), grid.dense_dp) / replicas
    errs["aux"] = rel_err(aux, ref.aux_loss)
    keep_ref = ref.routing.keep.view(batch, cfg.seq_len, -1)[idx].reshape(-1, cfg.topk)
    errs["same_drops"] = bool(torch.equal(layer.routing.keep, keep_ref))
    errs["dropped"] = int((~layer.routing.keep).sum())
    errs["counts"] = bool(torch.equal(layer.tokens_per_expert, ref.tokens_per_expert))
    return errs


def _check(results):
    for rank, errs in enumerate(results):
        assert errs.pop("same_drops") and errs.pop("counts"), f"rank {rank}: routing differs"
        errs.pop("dropped")
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, f"rank {rank}: {worst} rel err {errs[worst]:.2e}: {errs}"


CASES = [  # (name, ParallelConfig, ModelConfig changes, dispatcher)
    ("ep2 top2", ParallelConfig(ep=2), {}, "alltoall"),
    ("ep2 top1 pre-softmax", ParallelConfig(ep=2), {"topk": 1, "router_pre_softmax": True}, "alltoall"),
    ("ep4 one expert each", ParallelConfig(ep=4), {}, "alltoall"),
    ("ep2 x tp2 sp", ParallelConfig(ep=2, tp=2, sequence_parallel=True),
     {"activation": "swiglu"}, "alltoall"),
    ("ep2 x dp2", ParallelConfig(ep=2, dp=2), {}, "alltoall"),
    ("ep2 capacity 1.0", ParallelConfig(ep=2), {"capacity_factor": 1.0}, "alltoall"),
    ("ep2 x tp2 sp capacity 1.0", ParallelConfig(ep=2, tp=2, sequence_parallel=True),
     {"capacity_factor": 1.0}, "alltoall"),
    ("allgather ep2 x tp2 sp", ParallelConfig(ep=2, tp=2, sequence_parallel=True),
     {"capacity_factor": 1.0}, "allgather"),
]


@pytest.mark.parametrize("name,pcfg,changes,dispatcher", CASES, ids=[c[0] for c in CASES])
def test_parallel_layer_equals_reference(run_ranks, name, pcfg, changes, dispatcher):
    cfg = dataclasses.replace(CFG, **changes)
    results = run_ranks(layer_errors, pcfg, cfg, dispatcher, world_size=pcfg.world_size)
    dropped = sum(r["dropped"] for r in results)
    _check(results)
    if cfg.capacity_factor is not None:
        assert dropped > 0, "capacity 1.0 should drop some pairs of this routing"


@pytest.mark.parametrize("plant", ["split", "unpermute"])
def test_planted_dispatch_bug_is_caught(run_ranks, plant):
    results = run_ranks(layer_errors, ParallelConfig(ep=2), CFG, "alltoall", plant, world_size=2)
    with pytest.raises(AssertionError, match="rel err"):
        _check(results)


def test_grouped_experts_on_one_rank_equal_the_loop():
    """No processes: a grid of one runs the grouped matmul; the reference loops over experts."""
    _check([layer_errors(ParallelConfig(), dataclasses.replace(CFG, bias=False))])


# ---- bytes ----
def traffic(pcfg, cfg, batch=4):
    """(counted all-to-all bytes and wire bytes, the formula's) for one forward and backward."""
    grid = build_grid(pcfg)
    ref = _reference(cfg)
    layer = ParallelMoE(cfg, grid)
    layer.load_state_dict(shard_moe_state_dict(ref.state_dict(), grid.ep.size, grid.ep.rank,
                                               grid.tp.size, grid.tp.rank))
    x, _ = _data(cfg, batch)
    xp = x[_my_slice(grid, batch, cfg.seq_len)].clone().requires_grad_()
    with comm.counting() as counter:
        layer(xp).sum().backward()
    # formula: rows for member d = j*tp + t are the pairs this rank routed to ep rank j's experts
    E_local, R, h, elem = cfg.n_experts // grid.ep.size, grid.tp_ep.size, cfg.hidden, 4
    mine = torch.bincount(layer.routing.experts[layer.routing.keep], minlength=cfg.n_experts)
    per_ep = mine.view(grid.ep.size, E_local).sum(1)
    sent = [int(per_ep[j]) for j in range(grid.ep.size) for _ in range(grid.tp.size)]
    recv = comm.all_to_all(torch.tensor(sent), grid.tp_ep).tolist()   # not counted: outside
    me = grid.tp_ep.rank
    counts_bytes = R * E_local * 8
    payload = counts_bytes + (sum(sent) + sum(recv)) * h * elem * 2          # forward + backward
    wire = counts_bytes * (R - 1) / R + (sum(sent) - sent[me] + sum(recv) - recv[me]) * h * elem * 2
    return counter.bytes("all_to_all", "tp_ep"), counter.wire_bytes("all_to_all", "tp_ep"), payload, wire


@pytest.mark.parametrize("pcfg", [ParallelConfig(ep=2), ParallelConfig(ep=2, tp=2, sequence_parallel=True)],
                         ids=["ep2", "ep2xtp2sp"])
def test_all_to_all_bytes_equal_the_formula(run_ranks, pcfg):
    for counted, wire, payload, wire_formula in run_ranks(traffic, pcfg, CFG, world_size=pcfg.world_size):
        assert counted == payload and wire == pytest.approx(wire_formula, abs=1e-9)


# ---- the router's rules, on one process ----
def test_router_gates_and_capacity_drops_in_sequence_order():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [2.0, 2.5, 0.0, 0.0], [5.0, 0.0, 1.0, 0.0]])
    post = route(logits, dataclasses.replace(CFG, topk=2))
    assert post.experts.tolist() == [[0, 1], [1, 0], [0, 2]]
    assert torch.allclose(post.gates.sum(-1), torch.ones(3))
    pre = route(logits, dataclasses.replace(CFG, topk=1, router_pre_softmax=True))
    assert torch.allclose(pre.gates[:, 0], torch.softmax(logits, -1).max(-1).values)
    cfg = dataclasses.replace(CFG, topk=2, capacity_factor=0.5, seq_len=3)
    assert capacity(cfg, 3) == 1                 # ceil(0.5 * 3 * 2 / 4)
    kept = apply_capacity(post, cfg, rows=1, seq=3).keep
    # expert 0 is chosen by tokens 0, 1, 2: only token 0 keeps it; expert 1 by 0 and 1: token 0
    assert kept.tolist() == [[True, True], [False, False], [False, True]]


def test_configuration_errors_say_what_to_change():
    with pytest.raises(ValueError, match="1 <= topk <= 4"):
        ModelConfig(n_experts=4, topk=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        ModelConfig(n_experts=4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="use recompute='selective' or recompute='none'"):
        ModelConfig(n_experts=4, recompute="full")
    with pytest.raises(ValueError, match="router never learns"):
        ModelConfig(n_experts=4, topk=1, aux_loss_coeff=0.0)
    with pytest.raises(ValueError, match="without SP every tp rank holds every token"):
        validate_model(ParallelConfig(tp=2, ep=2), CFG)
    with pytest.raises(ValueError, match="not divisible by ep=3"):
        validate_model(ParallelConfig(ep=3), CFG)
    with pytest.raises(ValueError, match="has none"):
        validate_model(ParallelConfig(ep=2), dataclasses.replace(CFG, n_experts=0))


def test_dense_model_is_unchanged_and_moe_every_places_the_experts():
    dense = dataclasses.replace(CFG, n_experts=0)
    torch.manual_seed(0)
    names = [n for n, _ in GPT(dense).named_parameters()]
    assert not any("experts" in n or "router" in n for n in names)
    moe = GPT(dataclasses.replace(CFG, n_layers=4, moe_every=2))
    assert [isinstance(b.mlp, MoE) for b in moe.layers] == [True, False, True, False]


# ---- balance over a short training run ----
def _imbalanced_run(aux_coeff=0.0, bias_rate=0.0, steps=20):
    cfg = dataclasses.replace(CFG, n_layers=1, aux_loss_coeff=aux_coeff, z_loss_coeff=0.0, topk=1,
                              expert_bias=bias_rate > 0, router_pre_softmax=True)
    torch.manual_seed(0)
    model = GPT(cfg, seed=3)
    moe = model.layers[0].mlp
    with torch.no_grad():              # deliberately imbalanced: expert 0 wins every token
        v = torch.full((cfg.hidden,), cfg.hidden ** -0.5)   # a unit vector every token carries
        model.layers[0].mlp_norm.bias.copy_(v)
        moe.router.weight[0] += 3 * v
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    ratios = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        ratios.append(imbalance(moe.tokens_per_expert))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bias_rate:
            update_expert_bias(moe.expert_bias, moe.tokens_per_expert, bias_rate)
    return ratios


def test_aux_loss_pulls_an_imbalanced_router_toward_balance():
    """Top-1 routing with every token on expert 0 (ratio 4 = E); 32 tokens a step, so the
    per-step ratio is noisy: compare the mean of the last 10 steps."""
    without, with_aux = _imbalanced_run(0.0), _imbalanced_run(0.1)
    assert with_aux[0] == 4.0 and without[0] == 4.0      # it starts with one expert taking all
    late = sum(with_aux[-10:]) / 10
    assert late < 0.75 * with_aux[0]                       # the aux loss balances it
    assert late < sum(without[-10:]) / 10 - 1              # training alone does not


def test_expert_bias_balances_without_an_aux_loss():
    ratios = _imbalanced_run(0.0, bias_rate=0.05)
    assert sum(ratios[-10:]) / 10 < 0.75 * ratios[0]


def test_the_package_imports_on_its_own():
    """minitron.model imports minitron.moe; importing minitron.moe first must work too."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", "import minitron.moe.experts, minitron.moe"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
