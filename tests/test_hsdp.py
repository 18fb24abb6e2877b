"""Hybrid sharded data parallelism: ZeRO inside dp_shard ranks, replicated across the rest.

Groups: the shard and replicate groups tile dense_dp, meeting in one rank. Numbers: verify's
rows (logits, loss, dL/dX, every gradient, updated weights, replicas bitwise) at dp = 4 =
2 shards x 2 replicas, ZeRO 1, 2 and 3, each PASS; with the all-reduce across replicas
planted away the gradients and the replicas FAIL. Memory and traffic: a bf16 model's bytes
per rank equal ZeRO's table at N = dp_shard, and the wire bytes counted on each group equal
data_parallel.memory.hsdp_wire_bytes, exactly. The clipped norm counts each shard once.
"""
import pytest
import torch

from minitron.data_parallel import formula_bytes, hsdp_wire_bytes, measure, traffic_wire_bytes, wrap
from minitron.train.step import forward_backward
from minitron.grid import GROUP_DIMS, ParallelConfig, build_grid
from minitron.model import ModelConfig, ParallelGPT
from minitron.config import ConfigError
from minitron.runtime import comm
from minitron.grid.subgroups import SUBGROUP_DIMS
from minitron.train import cli as train_cli
from minitron.train.engine import TrainingRun
from minitron.verify import cli as verify_cli, make_batch
from minitron.verify.checks import Report
from minitron.verify.steps import run_rank
from test_data_parallel import BASE, EPS, LR, SEED

HSDP = ParallelConfig(dp=4, dp_shard=2)          # shard groups [0, 1], [2, 3]; replicas [0, 2], [1, 3]


def test_shard_and_replicate_groups_tile_dense_dp():
    cfg = ParallelConfig(tp=2, cp=2, dp=4, dp_shard=2)
    shards, replicas = cfg.group_ranks(SUBGROUP_DIMS["dense_dp_shard"]), cfg.group_ranks(SUBGROUP_DIMS["dp_replicate"])
    assert shards[0] == [0, 2, 4, 6] and replicas[0] == [0, 8]        # shard neighbours, copies far
    for dense in cfg.group_ranks(GROUP_DIMS["dense_dp"]):
        mine = [g for g in shards if set(g) <= set(dense)]
        copies = [g for g in replicas if set(g) <= set(dense)]
        assert len(mine) == cfg.dp_replicate and len(copies) == len(dense) // cfg.dp_replicate
        assert all(len(set(s) & set(r)) == 1 for s in mine for r in copies)
    assert ParallelConfig(dp=4) == ParallelConfig(dp=4, dp_shard=4) and "dp_shard" not in repr(ParallelConfig(dp=4))


def test_bad_dp_shard_is_refused_naming_the_flag_and_a_value(capsys, monkeypatch):
    with pytest.raises(ConfigError, match="dp_shard=3 must divide dp=4.*dp_shard=2"):
        ParallelConfig(dp=4, dp_shard=3)
    monkeypatch.setattr(verify_cli, "verify", lambda *a, **k: pytest.fail("a rank was started"))
    assert verify_cli.main(["--tp", "1", "--dp", "4", "--dp-shard", "3", "--zero", "1"]) == 2
    assert "--dp-shard 3 must divide --dp 4" in capsys.readouterr().err
    assert verify_cli.main(["--tp", "1", "--dp", "4", "--dp-shard", "2"]) == 2      # ZeRO 0
    assert "use --zero 1 or --zero 3 or drop --dp-shard" in capsys.readouterr().err
    assert train_cli.main(["--dp", "4", "--dp-shard", "8", "--zero", "3"]) == 2
    assert "--dp-shard 8 must divide --dp 4: ZeRO shards over dp_shard ranks, dp/dp_shard replicas; " \
           "use --dp-shard 4" in capsys.readouterr().err


def _verify(run_ranks, zero, plant=None) -> Report:
    mcfg = ModelConfig(**BASE, dropout=0.1)
    return Report(run_ranks(run_rank, HSDP, mcfg, 1, torch.float32, SEED, 1e-4, 1e-6, 4, None,
                            plant, None, zero, world_size=4)[0])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_verifies(run_ranks, zero):
    report = _verify(run_ranks, zero)
    assert report.passed, report.table()
    assert any(r.quantity == "replicas grads" for r in report.rows)


def test_planted_skipped_replica_all_reduce_is_caught(run_ranks):
    failed = {r.quantity.split(" ")[0] for r in _verify(run_ranks, 2, "hsdp-no-replicate").rows if not r.ok}
    assert {"grad", "replicas"} <= failed


# ---- memory and bytes per group, exactly ---------------------------------------------------
def hsdp_memory_rank(stages):
    grid = build_grid(HSDP)
    mcfg = ModelConfig(**BASE)
    tokens, targets = make_batch(0, SEED, 8, mcfg.seq_len, mcfg.vocab_size)
    out = {}
    for stage in stages:
        model = ParallelGPT(mcfg, grid, seed=SEED).to(torch.bfloat16)
        engine, opt = wrap(model, grid, stage, bucket_numel=None, lr=LR, eps=EPS)
        engine.zero_grad()
        with comm.counting() as c:
            forward_backward(model, None, tokens, targets, 0, engine=engine)
            opt.step()
        wire = {g: c.wire_bytes(group=g) for g in ("dense_dp_shard", "dp_replicate")}
        loss_mean = c.wire_bytes(group="ep_dp")           # the step's loss, averaged over replicas
        out[stage] = dict(psi=sum(p.numel() for p in model.parameters()), padded=engine.padded_numel,
                          mem=measure(model, engine, opt), wire=wire, loss_mean=loss_mean,
                          other=c.wire_bytes() - sum(wire.values()) - loss_mean)
        engine.remove_hooks()
    return out


def test_memory_and_bytes_per_group_equal_the_formulas(run_ranks):
    for per_rank in run_ranks(hsdp_memory_rank, [1, 2, 3], world_size=4):
        for stage, got in per_rank.items():
            psi = got["psi"]
            assert psi == got["padded"] == 29_824                    # divides by dp_shard: no padding
            assert got["mem"] == formula_bytes(psi, HSDP.dp_shard, stage), stage
            want = hsdp_wire_bytes(psi, HSDP.dp_shard, HSDP.dp_replicate, stage)
            assert got["wire"] == {"dense_dp_shard": want["shard"], "dp_replicate": want["replicate"]}
            assert got["other"] == 0 and got["loss_mean"] == 2 * (3 / 4) * 4   # one float32
    # between replicas only the kept half of the bf16 gradient, all-reduced by 2: Ψ bytes a
    # rank, whatever the stage; flat ZeRO-1 over the same 4 ranks sends 2 (3/4) 2Ψ = 3Ψ there
    assert want["replicate"] == psi and traffic_wire_bytes(psi, 4, 1) == 3 * psi


# ---- the clipped norm counts each shard once --------------------------------------------------
def clipped_norms_rank():
    mcfg = ModelConfig(**BASE)
    norms = {}
    for pcfg in (ParallelConfig(dp=4), HSDP):
        run = TrainingRun(mcfg, pcfg, zero_stage=1, max_norm=0.05, lr=1e-2)
        tokens, targets = make_batch(0, SEED, 8, mcfg.seq_len, mcfg.vocab_size)
        losses = [run.step(tokens, targets, step) for step in range(2)]
        norms[pcfg.dp_replicate] = (losses, run.last_update["norm"])
    return norms


def test_clipping_sees_the_flat_zero_norm(run_ranks):
    norms = run_ranks(clipped_norms_rank, world_size=4)[0]
    (flat_losses, flat_norm), (losses, norm) = norms[1], norms[2]
    assert norm == pytest.approx(flat_norm, rel=1e-6) and norm > 0.05          # clipped, once
    assert losses == pytest.approx(flat_losses, rel=1e-6)
