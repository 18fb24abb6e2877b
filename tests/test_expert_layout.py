"""Megatron-Core's expert layout (minitron/moe/expert_layout.py) against Megatron-Core's own
algorithm, transcribed below as the oracle."""
import pytest

from minitron.grid import GROUP_DIMS, ParallelConfig
from minitron.config import ConfigError
from minitron.moe import expert_layout
from minitron.moe.expert_layout import expert_groups


# ---- the oracle: NVIDIA/Megatron-LM, megatron/core/parallel_state.py (main, August 2026),
# generate_masked_orthogonal_rank_groups and RankGenerator, transcribed line by line; left out:
# rank_offset (0 here) and the gtp_remat axis (size 1 here), which add nothing at these sizes.
def generate_masked_orthogonal_rank_groups(world_size, parallel_size, mask):
    def prefix_product(a, init=1):
        r = [init]
        for v in a:
            init = init * v
            r.append(init)
        return r

    def inner_product(a, b):
        return sum([x * y for x, y in zip(a, b)])

    def decompose(index, shape, stride=None):
        if stride is None:
            stride = prefix_product(shape)
        idx = [(index // d) % s for s, d in zip(shape, stride)]
        assert sum([x * y for x, y in zip(idx, stride[:-1])]) == index
        return idx

    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    global_stride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = prefix_product(masked_shape)[-1]
    num_of_group = world_size // group_size
    ranks = []
    for group_index in range(num_of_group):
        decomposed_group_idx = decompose(group_index, unmasked_shape)
        rank = []
        for rank_in_group in range(group_size):
            decomposed_rank_idx = decompose(rank_in_group, masked_shape)
            rank.append(inner_product(decomposed_rank_idx, masked_stride)
                        + inner_product(decomposed_group_idx, unmasked_stride))
        ranks.append(rank)
    return ranks


class RankGenerator:
    def __init__(self, tp, ep, dp, pp, cp, order):
        assert ep == 1 or cp == 1, "CP only in the default generator, EP only in the expert one"
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        order = order.lower()
        for name in self.name_to_size:
            if name not in order and self.name_to_size[name] != 1:
                raise RuntimeError(f"the size of {name} is {self.name_to_size[name]}, not in {order}")
            elif name not in order:
                order = order + "-" + name
        self.order = order
        self.ordered_size = [self.name_to_size[token] for token in order.split("-")]

    def get_mask(self, order, token):
        ordered_token = order.split("-")
        mask = [False] * len(ordered_token)
        for t in token.split("-"):
            mask[ordered_token.index(t)] = True
        return mask

    def get_ranks(self, token):
        mask = self.get_mask(self.order, token)
        return generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)


def megatron_generators(tp, cp, ep, dp, pp, etp):
    """initialize_model_parallel's two generators; its data_parallel_size is world/(tp*cp*pp)."""
    world = tp * cp * ep * dp * pp
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    return dense, expert


def canonical(groups):
    return sorted(sorted(g) for g in groups)


SIZES = [  # tp, cp, ep, dp, pp, expert tp
    (1, 2, 2, 1, 1, 1), (2, 2, 2, 1, 1, 2), (2, 2, 2, 2, 1, 1), (1, 1, 2, 2, 1, 1),
    (2, 1, 4, 1, 2, 1), (2, 2, 2, 1, 2, 4), (4, 2, 2, 1, 1, 2), (2, 3, 2, 1, 1, 1),
    (1, 4, 2, 2, 2, 2), (8, 1, 8, 2, 1, 1),
]


@pytest.mark.parametrize("tp, cp, ep, dp, pp, etp", SIZES)
def test_megatron_core_expert_groups_equal_its_rank_generator(tp, cp, ep, dp, pp, etp):
    cfg = ParallelConfig(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)
    _, oracle = megatron_generators(tp, cp, ep, dp, pp, etp)
    ours = expert_groups(cfg, "megatron-core", expert_tp=etp)
    for name, token in (("expert_tp", "tp"), ("ep", "ep"), ("expert_tp_ep", "tp-ep"), ("expert_dp", "dp")):
        assert ours[name] == canonical(oracle.get_ranks(token)), name


@pytest.mark.parametrize("tp, cp, ep, dp, pp, etp", SIZES)
def test_dense_groups_are_megatron_cores_in_both_layouts(tp, cp, ep, dp, pp, etp):
    cfg = ParallelConfig(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)
    dense, _ = megatron_generators(tp, cp, ep, dp, pp, etp)
    for name, token in (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("ep_dp", "dp"), ("dense_dp", "dp-cp")):
        assert cfg.group_ranks(GROUP_DIMS[name]) == canonical(dense.get_ranks(token)), name


@pytest.mark.parametrize("tp, cp, ep, dp, pp, etp", SIZES)
def test_the_layouts_agree_exactly_when_cp_is_1_and_expert_tp_is_tp(tp, cp, ep, dp, pp, etp):
    cfg = ParallelConfig(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)
    same = expert_groups(cfg) == expert_groups(cfg, "megatron-core", expert_tp=tp)
    assert same == (cp == 1 or ep == 1)
    if etp != tp:
        assert expert_groups(cfg, "megatron-core", expert_tp=etp)["expert_tp"] != expert_groups(cfg)["expert_tp"]


def test_bad_expert_sizes_are_refused_with_values_that_work():
    cfg = ParallelConfig(tp=2, cp=2, ep=2)
    with pytest.raises(ConfigError, match=r"expert_tp=3 \* ep=2 \* pp=1 must divide the 8 ranks.*"
                                          r"use expert_tp=2 or expert_tp=4"):
        expert_groups(cfg, "megatron-core", expert_tp=3)
    with pytest.raises(ConfigError, match="experts are split over tp: expert_tp=1 must equal tp=2"):
        expert_groups(cfg, expert_tp=1)
    with pytest.raises(ConfigError, match="expert_layout='deepspeed': choose one of"):
        expert_groups(cfg, "deepspeed")


def test_explain_lists_megatron_cores_expert_groups():
    text = expert_layout.explain(ParallelConfig(cp=2, ep=2), "megatron-core")
    assert "expert groups, megatron-core layout (expert tp 1, expert dp 2):" in text
    assert "  ep              2 x 2   inside a node              [0, 1], [2, 3]" in text
    assert "  expert_dp       2 x 2   inside a node              [0, 2], [1, 3]" in text
