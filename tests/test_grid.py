"""The rank grid: coordinates, Megatron's tp-cp-ep-dp-pp order, groups, validation."""
import dataclasses
import itertools
import types

import torch

import pytest

from minitron.grid import AMAX_DIMS, GROUP_DIMS, ParallelConfig, build_grid, pad_vocab_size
from minitron.model.splits import validate_model
from minitron.grid.subgroups import SUBGROUP_DIMS
from minitron.config import ModelConfig

CONFIGS = [
    ParallelConfig(tp=2, dp=2, pp=2),
    ParallelConfig(tp=2, cp=2, ep=1, dp=1, pp=2),
    ParallelConfig(tp=1, cp=1, ep=2, dp=3, pp=1),
    ParallelConfig(tp=2, cp=2, ep=2, dp=2, pp=2),
    ParallelConfig(),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_coords_round_trip(cfg):
    seen = set()
    for rank in range(cfg.world_size):
        c = cfg.coords(rank)
        assert cfg.rank_of(**c) == rank
        seen.add(tuple(c.values()))
    # every coordinate tuple appears exactly once
    assert len(seen) == cfg.world_size
    assert seen == set(itertools.product(*(range(n) for n in cfg.sizes().values())))


def test_megatron_order_tp_dp_pp():
    cfg = ParallelConfig(tp=2, dp=2, pp=2)
    assert cfg.group_ranks(GROUP_DIMS["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cfg.group_ranks(GROUP_DIMS["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cfg.group_ranks(GROUP_DIMS["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cfg.embedding_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cfg.coords(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert cfg.coords(6) == {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 1}


def test_megatron_order_with_cp_and_ep():
    # tp fastest, then cp, ep, dp, pp slowest: rank = tp + 2*(cp + 2*(ep + 2*(dp + 2*pp)))
    cfg = ParallelConfig(tp=2, cp=2, ep=2, dp=2, pp=2)
    assert cfg.rank_of(tp=1, cp=1, ep=1, dp=1, pp=1) == 31
    assert cfg.rank_of(cp=1) == 2 and cfg.rank_of(ep=1) == 4
    assert cfg.rank_of(dp=1) == 8 and cfg.rank_of(pp=1) == 16
    assert cfg.group_ranks(GROUP_DIMS["cp"])[0] == [0, 2]
    assert cfg.group_ranks(GROUP_DIMS["ep"])[0] == [0, 4]
    assert cfg.group_ranks(GROUP_DIMS["dp_cp"])[0] == [0, 2, 8, 10]
    assert cfg.group_ranks(GROUP_DIMS["dense_dp"])[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert cfg.group_ranks(GROUP_DIMS["tp_ep"])[0] == [0, 1, 4, 5]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_every_group_kind_partitions_the_world(cfg):
    kinds = {name: cfg.group_ranks(dims) for name, dims in GROUP_DIMS.items()}
    for name, groups in kinds.items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(cfg.world_size)), name
        size = 1
        for d in GROUP_DIMS[name]:
            size *= getattr(cfg, d)
        assert all(len(g) == size for g in groups), name
        # inside a group only the group's own dimensions vary
        fixed = [d for d in cfg.sizes() if d not in GROUP_DIMS[name]]
        for g in groups:
            assert len({tuple(cfg.coords(r)[d] for d in fixed) for r in g}) == 1, name


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_embedding_groups_are_first_and_last_stage(cfg):
    for group, pipe in zip(cfg.embedding_ranks(), cfg.group_ranks(("pp",))):
        assert group == sorted({pipe[0], pipe[-1]})
        assert {cfg.coords(r)["pp"] for r in group} == {0, cfg.pp - 1}


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 8) == 50264
    assert pad_vocab_size(64, 4) == 64
    assert pad_vocab_size(65, 2, multiple=64) == 128


# ---- validation: each bad input raises ValueError saying what to change ----
MODEL = ModelConfig(vocab_size=64, seq_len=16, hidden=48, n_layers=4, n_heads=4)


def test_world_size_mismatch():
    with pytest.raises(ValueError, match=r"world size 6 .* = 8.*launch 8 ranks"):
        ParallelConfig(tp=2, dp=2, pp=2).validate(world_size=6)


@pytest.mark.parametrize("model, cfg, words", [
    (dataclasses.replace(MODEL, n_heads=6, hidden=48), ParallelConfig(tp=4),
     ["n_heads=6", "tp=4", "use tp=2"]),
    (dataclasses.replace(MODEL, n_heads=4, n_kv_heads=1), ParallelConfig(tp=2),
     ["n_kv_heads=1", "tp=2", "use tp=1"]),
    (MODEL, ParallelConfig(pp=3),
     ["n_layers=4", "pp=3 * virtual_pp=1", "same number of layers", "use pp=2 or pp=4 or n_layers=6"]),
    (MODEL, ParallelConfig(pp=2, virtual_pp=4),
     ["n_layers=4", "pp=2 * virtual_pp=4", "use pp=1 or n_layers=8"]),
    (dataclasses.replace(MODEL, seq_len=18), ParallelConfig(tp=4, sequence_parallel=True),
     ["seq_len=18", "tp=4 * cp=1", "use seq_len=20"]),
    (dataclasses.replace(MODEL, seq_len=18), ParallelConfig(cp=2),
     ["seq_len=18", "2 * cp=2", "2*cp chunks", "use cp=1 or cp=3 or seq_len=20"]),
    (dataclasses.replace(MODEL, vocab_size=65), ParallelConfig(tp=2),
     ["vocab_size=65", "tp=2", "use vocab_size=66", "pad_vocab_size"]),
    (types.SimpleNamespace(**{**dataclasses.asdict(MODEL), "n_experts": 6}), ParallelConfig(ep=4),
     ["n_experts=6", "ep=4", "same number of experts", "use ep=3 or ep=6 or n_experts=8"]),
], ids=["heads", "kv_heads", "layers_pp", "layers_virtual", "seq_sp", "seq_cp", "vocab", "experts"])
def test_validate_model_errors(model, cfg, words):
    with pytest.raises(ValueError) as info:
        validate_model(cfg, model)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_validate_model_accepts_good_split():
    validate_model(ParallelConfig(tp=4, pp=2, cp=2, sequence_parallel=True), MODEL)


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValueError, match="needs tp > 1.*use tp=2 or sequence_parallel=False"):
        ParallelConfig(tp=1, sequence_parallel=True)


@pytest.mark.parametrize("field, value", [("tp", 0), ("dp", -1), ("pp", 1.5), ("virtual_pp", 0)])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r} must be a positive integer \(ParallelConfig.{field}\); use {field}=1"):
        ParallelConfig(**{field: value})


# ---- a real grid on 8 processes ----
def _grid_worker(cfg):
    grid = build_grid(cfg)
    again = cfg.build()   # the same object: groups are built once per world
    groups = {name: list(g.ranks) for name, g in grid.groups.items()}
    return {"rank": grid.rank, "coords": dict(grid.coords), "groups": groups,
            "cached": again is grid, "tp_rank": grid.tp_rank, "pp_rank": grid.pp_rank,
            "named": all(getattr(grid, name) is g for name, g in grid.groups.items())
            and all(getattr(grid, f"{d}_rank") == grid.coords[d] for d in grid.coords),
            "first": grid.is_first_stage, "last": grid.is_last_stage,
            "group_rank": {name: g.rank for name, g in grid.groups.items()}}


def test_built_grid_matches_pure_functions(run_ranks):
    cfg = ParallelConfig(tp=2, dp=2, pp=2)
    results = run_ranks(_grid_worker, cfg, world_size=8)
    expected = {name: cfg.group_ranks(dims) for name, dims in {**GROUP_DIMS, **SUBGROUP_DIMS}.items()}
    expected["embedding"] = cfg.embedding_ranks()
    expected["amax"] = cfg.group_ranks(AMAX_DIMS)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["cached"] and res["named"]
        assert res["coords"] == cfg.coords(rank)
        assert res["tp_rank"] == rank % 2 and res["pp_rank"] == rank // 4
        assert res["first"] == (rank < 4) and res["last"] == (rank >= 4)
        for name, ranks in res["groups"].items():
            assert ranks in expected[name], (rank, name)
            assert rank in ranks
            assert res["group_rank"][name] == ranks.index(rank)
        assert set(res["groups"]) == set(expected)


def _shared_groups_worker():
    import torch.distributed as dist
    tp, dp = ParallelConfig(tp=2).build(), ParallelConfig(dp=2).build()
    x = torch.ones(1)
    dist.all_reduce(x, group=dp.dp.pg)
    return {"shared": tp.tp.pg is dp.dp.pg, "distinct_grids": tp is not dp, "sum": x.item()}


def test_grids_share_a_process_group_of_the_same_ranks(run_ranks):
    """tp=2's [0, 1] and dp=2's [0, 1] are one gloo group: a rank pool building many grids
    keeps a few groups (each holds threads and sockets), and the shared one still reduces."""
    for res in run_ranks(_shared_groups_worker, world_size=2):
        assert res == {"shared": True, "distinct_grids": True, "sum": 2.0}
