"""Node-limited routing (--max-nodes M, DeepSeek-V3 sec. 2.1.2): the E experts in G equal groups,
each token keeps its M best groups (a group scored by the sum of its top-(k/M) scores) and takes
its top-k among their experts only (minitron/moe/router.py, limit_groups).

Checked: a hand-made token whose choice the limit changes (the sum of a group's best k/M, not its
single best); every token's experts in at most M groups on random logits, while the unlimited
router spans more (so the check can fail); verify's split against one device PASSes with margin
>= 3x and a planted dispatch bug still FAILs; with groups = ep ranks and M = 1 the dispatch
all-to-all, counted by minitron.runtime.comm, sends each token's k rows to one rank only: its
rows leaving the rank are k times the tokens routed to the other rank, the count the routing
gives; bad values exit 2 with one line naming the flag and a value that works.
"""
import dataclasses

import pytest
import torch

from minitron.config import ConfigError, ModelConfig
from minitron.grid import ParallelConfig, build_grid
from minitron.model.reference import init_weights
from minitron.moe import MoE, ParallelMoE, route
from minitron.moe.experts import shard_moe_state_dict
from minitron.moe.router import limit_groups
from minitron.runtime.counting import CommCounter, _active
from minitron.train import flags as train_flags
from minitron.verify import Report, run_rank
from minitron.verify import cli as verify_cli

CFG = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, n_experts=8,
                  topk=2, z_loss_coeff=1e-3, max_groups=1, expert_groups=2)


def _groups_per_token(experts, n_experts, groups):
    g = experts // (n_experts // groups)
    return torch.tensor([len(set(row)) for row in g.tolist()])


# ---- the rule, on one process ----
def test_hand_made_token_whose_choice_the_limit_changes():
    # groups {0, 1} and {2, 3}: expert 0 is the single best, but group 1's two best sum higher
    logits = torch.tensor([[5.0, 0.0, 4.0, 3.0]])
    free = ModelConfig(n_experts=4, topk=2)
    limited = dataclasses.replace(free, max_groups=1, expert_groups=2)
    assert sorted(route(logits, free).experts[0].tolist()) == [0, 2]
    r = route(logits, limited)
    assert r.experts[0].tolist() == [2, 3]
    assert torch.allclose(r.gates[0], torch.softmax(torch.tensor([4.0, 3.0]), -1))   # gates as always
    masked = limit_groups(logits, 2, 1, 2)
    assert masked[0, :2].tolist() == [float("-inf")] * 2 and masked[0, 2:].tolist() == [4.0, 3.0]
    # the bias enters the group scores too (choosing), and not the gates
    bias = torch.tensor([0.0, 3.0, 0.0, 0.0])
    rb = route(logits, limited, bias)
    assert rb.experts[0].tolist() == [0, 1]
    assert torch.allclose(rb.gates[0], torch.softmax(torch.tensor([5.0, 0.0]), -1))
    # pre-softmax: groups are scored in probabilities, where group 0 sums the more
    # (e^5 + e^0 > e^4 + e^3), and the gates are the probabilities at the chosen two
    pre = route(logits, dataclasses.replace(limited, router_pre_softmax=True))
    assert pre.experts[0].tolist() == [0, 1]
    assert torch.allclose(pre.gates[0], torch.softmax(logits[0], -1)[:2])


@pytest.mark.parametrize("E,G,M,k", [(16, 4, 1, 4), (16, 4, 2, 4), (8, 4, 1, 2), (12, 3, 2, 6)])
def test_every_token_in_at_most_max_groups_groups(E, G, M, k):
    logits = torch.randn(512, E, generator=torch.Generator().manual_seed(E + G + M + k))
    cfg = ModelConfig(n_experts=E, topk=k, max_groups=M, expert_groups=G)
    r = route(logits, cfg)
    assert int(_groups_per_token(r.experts, E, G).max()) <= M
    unlimited = route(logits, dataclasses.replace(cfg, max_groups=None, expert_groups=None))
    assert int(_groups_per_token(unlimited.experts, E, G).max()) > M   # the check can fail
    # against a loop over tokens: the M best group sums, then the top-k inside them
    for t in range(0, 512, 37):
        sums = logits[t].view(G, E // G).topk(k // M).values.sum(-1)
        keep = set(sums.topk(M).indices.tolist())
        inside = [e for e in range(E) if e // (E // G) in keep]
        best = sorted(inside, key=lambda e: -float(logits[t, e]))[:k]
        assert sorted(r.experts[t].tolist()) == sorted(best)


# ---- verify: the split against one device ----
SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1, n_experts=8,
             topk=2, max_groups=1, expert_groups=2)


@pytest.mark.parametrize("plant", [None, "moe-split"])
def test_verify_passes_and_a_planted_bug_fails(run_ranks, plant):
    pcfg = ParallelConfig(ep=2)
    report = Report(run_ranks(run_rank, pcfg, ModelConfig(**SMALL), 2, batch=2, plant=plant,
                              world_size=2)[0])
    if plant:
        assert not report.passed, report.table()
        return
    assert report.passed, report.table()
    worst = report.worst(report.rows)
    assert worst.err <= worst.tol / 3, report.table()


def test_verify_command_line_passes():
    assert verify_cli.main(["--tp", "1", "--ep", "2", "--experts", "8", "--topk", "2",
                            "--max-nodes", "1", "--steps", "1", "--layers", "1"]) == 0


# ---- bytes: the dispatch all-to-all, counted ----
class _Log(CommCounter):
    """A counter that also keeps every call, in order."""

    def __init__(self):
        super().__init__()
        self.calls_in_order = []

    def add(self, group, op, payload, wire):
        super().add(group, op, payload, wire)
        self.calls_in_order.append((group, op, payload, wire))


def dispatch_rows(pcfg, cfg, batch=4):
    """Run on every rank: (rows the dispatch all-to-all sends, of them to another rank; the
    tokens whose experts are all on the other rank, those split over both; n, k)."""
    grid = build_grid(pcfg)
    ref = MoE(cfg)
    init_weights(ref, cfg, seed=1)
    with torch.no_grad():
        ref.router.weight.mul_(20)           # a router with opinions
    layer = ParallelMoE(cfg, grid)
    layer.load_state_dict(shard_moe_state_dict(ref.state_dict(), grid.ep.size, grid.ep.rank, 1, 0))
    x = torch.randn(batch, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(7))
    rows = batch // grid.dense_dp.size
    mine = x[grid.dense_dp.rank * rows:(grid.dense_dp.rank + 1) * rows]
    log = _Log()
    _active.append(log)
    try:
        with torch.no_grad():
            layer(mine)
    finally:
        _active.remove(log)
    a2a = [c for c in log.calls_in_order if c[:2] == ("tp_ep", "all_to_all")]
    assert len(a2a) == 3                     # counts, dispatch, combine (dispatch.py)
    row = cfg.hidden * 4
    _, _, payload, wire = a2a[1]
    on_rank = layer.routing.experts // (cfg.n_experts // grid.ep.size)      # [n, k] ep rank
    remote = (on_rank != grid.ep.rank)
    all_remote = int(remote.all(1).sum())
    split = int((remote.any(1) & ~remote.all(1)).sum())
    n, k = layer.routing.experts.shape
    return payload // row, wire / row, int(remote.sum()), all_remote, split, n, k


def test_dispatch_sends_each_tokens_rows_to_one_rank(run_ranks):
    pcfg = ParallelConfig(ep=2)
    for sent, leaving, remote_pairs, all_remote, split, n, k in run_ranks(
            dispatch_rows, pcfg, CFG, world_size=2):
        assert sent == n * k                               # k rows per token (dropless)
        assert leaving == remote_pairs                     # counted = the routing's count
        assert split == 0 and leaving == k * all_remote    # all k rows to one rank, M = 1
        assert leaving <= k * n                            # the formula: k rows, <= M ranks
    free = dataclasses.replace(CFG, max_groups=None, expert_groups=None)
    splits = [r[4] for r in run_ranks(dispatch_rows, pcfg, free, world_size=2)]
    assert sum(splits) > 0                                 # without the limit tokens split


# ---- bad values: one line naming the flag and a value that works ----
@pytest.mark.parametrize("argv,message", [
    (["--max-nodes", "3"], "--max-nodes 3: each token keeps 1 to --expert-groups 2 groups; use --max-nodes 1"),
    (["--max-nodes", "1", "--expert-groups", "3"],
     "--expert-groups 3 must divide --experts 8 (equal groups); use --expert-groups 2 or --expert-groups 4"),
    (["--max-nodes", "2", "--topk", "3"], "--max-nodes 2 must divide --topk 3"),
    (["--expert-groups", "2"], "use --max-nodes 1 or drop --expert-groups"),
])
def test_bad_values_exit_2_naming_the_flag(capsys, argv, message):
    assert verify_cli.main(["--tp", "1", "--ep", "2", "--experts", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_train_flags_build_the_groups_and_refuse_bad_values():
    args = train_flags.parser().parse_args(["--ep", "4", "--experts", "8", "--max-nodes", "2"])
    cfg = train_flags.model_config(args)
    assert (cfg.max_groups, cfg.expert_groups) == (2, 4)
    args = train_flags.parser().parse_args(["--ep", "2", "--experts", "8", "--topk", "4",
                                            "--max-nodes", "1", "--expert-groups", "4"])
    with pytest.raises(ConfigError) as e:
        train_flags.model_config(args)
    assert e.value.as_flags(train_flags.FLAGS).endswith("use --max-nodes 2")
    with pytest.raises(ConfigError, match="has none"):
        ModelConfig(max_groups=1, expert_groups=1)
