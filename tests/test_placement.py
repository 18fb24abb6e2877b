"""Placement on nodes (minitron/runtime/placement.py): which groups leave a node, the warning when a
tensor-parallel group does, and `python -m minitron.verify --explain`."""
import dataclasses
import warnings

import pytest

from minitron.grid import GROUP_DIMS, ParallelConfig, build_grid
from minitron.config import ConfigError
from minitron.runtime import placement
from minitron.verify import cli


def test_groups_that_cross_a_node_are_named():
    # 8 ranks on 2 nodes of 4: tp pairs sit inside a node, dp joins ranks 2 apart (0, 2, 4, 6)
    p = ParallelConfig(tp=2, dp=4, gpus_per_node=4)
    across = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert p.node_crossing_groups() == {"dp": across, "dp_cp": across, "dense_dp": across,
                                        "ep_dp": across}
    assert ParallelConfig(tp=2, dp=4).node_crossing_groups() == {}        # one node of 8


def test_pipeline_across_nodes_and_embedding_with_it():
    p = ParallelConfig(tp=4, pp=2, gpus_per_node=4)
    assert p.node_crossing_groups() == {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                        "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]]}


@pytest.mark.parametrize("cfg, group, nodes, nics", [
    (ParallelConfig(tp=8, dp=2, gpus_per_node=4), "[0-7]", 2, "4 NICs (at H100 rates 180 GB/s"),
    (ParallelConfig(tp=3, dp=4), "[6-8]", 2, "1 NIC (at H100 rates 45 GB/s"),   # ranks 6, 7 | 8
    (ParallelConfig(tp=16, gpus_per_node=4), "[0-15]", 4, "4 NICs (at H100 rates 180 GB/s"),
])
def test_tp_across_nodes_warns_in_one_line(cfg, group, nodes, nics):
    message = placement.tp_warning(cfg)
    assert message is not None and "\n" not in message
    assert f"tp group {group} spans {nodes} nodes" in message
    assert f"leave each node through {nics}" in message and "not NVLink's 360" in message


@pytest.mark.parametrize("cfg", [ParallelConfig(tp=8, dp=2), ParallelConfig(tp=4, pp=4, gpus_per_node=4),
                                 ParallelConfig(tp=3, gpus_per_node=4), ParallelConfig(dp=16)])
def test_tp_inside_nodes_does_not_warn(cfg):
    assert placement.tp_warning(cfg) is None


def test_gpus_per_node_is_checked_and_not_part_of_the_split():
    with pytest.raises(ConfigError, match="gpus_per_node=0 must be a positive integer"):
        ParallelConfig(gpus_per_node=0)
    a, b = ParallelConfig(tp=2), ParallelConfig(tp=2, gpus_per_node=4)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)    # the same grid, cached once
    assert dataclasses.replace(b, dp=2).gpus_per_node == 4


def _build_and_record(cfg):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_grid(cfg)
    return [str(w.message) for w in caught if issubclass(w.category, placement.PlacementWarning)]


def test_building_the_grid_warns_on_rank_0(run_ranks):
    cfg = ParallelConfig(tp=2, gpus_per_node=1)          # a node per GPU: the tp pair spans two
    first, second = run_ranks(_build_and_record, cfg, world_size=2)
    assert len(first) == 1 and "tp group [0, 1] spans 2 nodes of 1 GPUs" in first[0]
    assert second == []


def test_explain_prints_every_kind_and_starts_no_rank(capsys, monkeypatch):
    monkeypatch.setattr(cli, "verify", lambda *a, **k: pytest.fail("--explain started ranks"))
    assert cli.main(["--tp", "8", "--dp", "2", "--gpus-per-node", "4", "--explain"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert out.splitlines()[0].startswith("16 ranks on 4 nodes of 4 GPUs")
    assert set(rows) == {*GROUP_DIMS, "embedding"}
    assert "CROSSES nodes (up to 2)" in rows["tp"] and "[0-7], [8-15]" in rows["tp"]
    assert "[0, 8], [1, 9]" in rows["dp"]
    assert "one rank each" in rows["pp"]
    assert err.count("\n") == 1 and err.startswith("warning: tp group [0-7] spans 2 nodes")


def test_explain_inside_one_node():
    text = placement.explain(ParallelConfig(tp=2, cp=2, pp=2))
    assert "CROSSES" not in text
    assert "tp              4 x 2   inside a node              [0, 1], [2, 3], [4, 5], [6, 7]" in text


def test_bad_gpus_per_node_exits_2(capsys):
    assert cli.main(["--gpus-per-node", "0", "--explain"]) == 2
    assert "--gpus-per-node" in capsys.readouterr().err
