"""Issue 20's repros on the real exercises, graded in one run of the grader.

  tampered   a wrong answer plus a name an answer cell rebinds so that, were the checks run in
             the learner's namespace, the check would print the reference's verdicts: each must
             fail at the check named (§2);
  different  a right answer of another type or form than the reference's: each must pass (§3);
(The input transformer that replays the stored outputs is planted in every exercise's unsolved
notebook by test_grading.py; the tamperings of the kernel's machinery on the tiny course are in
test_grading_tamper.py.)
"""
from __future__ import annotations

import json

import pytest

from minitron.grade import cli as grader
from notebook_files import save
from test_grading import ROOT, planted, with_answers

PRINT_TRUE = '''import builtins
def print(*args, **kwargs):        # the check's verdicts read True
    line = " ".join(map(str, args))
    line = line.replace("yours equal: False", "yours equal: True").replace("yours agree: False", "yours agree: True")
    builtins.print("by hand: [2, 2, 1, 1, 0]" if line.startswith("by hand:") else line, **kwargs)


'''

TAMPERED = {  # name: (exercise, {answer cell id: source}, the check it must fail at)
    "04_simulate": ("04_pipeline_parallel.ipynb", {"e04c0008": '''def interleaved_idle(pp, m, v, F, B, W):
    return {r: (r * F, (pp - 1 - r) * (F + B + W), r * (B + W)) for r in range(pp)}   # wrong: not / v


def simulate(schedule, costs):   # the global the check calls: every timeline plain 1F1B's
    from minitron.pipeline.simulate import simulate as real
    return real(make_schedule("1f1b", schedule.pp, schedule.microbatches), costs)
'''}, "Check 2"),
    "04_simulates": ("04_pipeline_parallel.ipynb", {"e04c0008": '''def interleaved_idle(pp, m, v, F, B, W):
    from minitron.pipeline import make_schedule
    from minitron.pipeline.simulate import simulate as timed   # measured, not derived
    t = timed(make_schedule("1f1b" if v == 1 else "interleaved", pp, m, v), Costs(F, B, W))
    return idle_parts(t.events, pp)
'''}, "Check 2"),
    "05_with_messages": ("05_zero_bubble.ipynb", {"s05c03": '''from minitron.pipeline import make_schedule


def zb_h1_order(pp, m, rank):
    return []


def with_messages(name, pp, m, virtual, placement, compute):
    return make_schedule("zb-h1", pp, m)
'''}, "Check 1"),
    "06_show": ("06_data_parallel_and_zero.ipynb", {"e06c0004": '''from minitron.grade.values import show as _show


def show(label, value, **kwargs):    # the check's verdicts read True
    _show(label, True if "equal" in label else value, **kwargs)


def fp32_state_bytes(psi, n, stage):
    shard = lambda nbytes, from_stage: nbytes * psi // n if stage >= from_stage else nbytes * psi
    return shard(2, 3), shard(2, 2), shard(12, 1)      # wrong: lesson 06's bf16 bytes
'''}, "Check 1"),
    "07_print": ("07_mixed_precision.ipynb", {
        k: PRINT_TRUE + v for k, v in planted("07_mixed_precision.ipynb").WRONG.items()}, "Check 1"),
    "09_print": ("09_context_parallel.ipynb", {"1eede225": '''import builtins
def print(*args, **kwargs):        # every line reads as the reference's
    line = " ".join(map(str, args))
    if line.startswith("cp="):
        cp = int(line[3])
        line = (f"cp={cp}: every chunk once: True   scores per rank: [{[1040, 0, 2064, 0, 0, 0, 4112][cp - 2]}]   "
                "= s(s+1)/2/cp: True")
    builtins.print(line, **kwargs)


def balanced_chunks(cp, rank):
    return (rank, rank + cp)       # wrong: the last ranks do the most work
'''}, "Check 2"),
    "10_rel_err": ("10_triton_kernels.ipynb", {
        "b2d5eb57": None,  # filled below: the solution's kernels with RMSNorm's dx (no -mean(g) term)
        "1c5465b9": '''def attention_by_key_blocks(q, k, v, causal: bool, order, block_n: int):
    "Never rescales its accumulator when the running max grows."
    s, d = q.shape[-2], q.shape[-1]
    qf = q.float() / math.sqrt(d)
    m = torch.full(q.shape[:-1], -math.inf)
    l = torch.zeros(q.shape[:-1])
    acc = torch.zeros(q.shape, dtype=torch.float32)
    rows = torch.arange(s)[:, None]
    for blk in order:
        lo, hi = blk * block_n, min((blk + 1) * block_n, k.shape[-2])
        scores = qf @ k[..., lo:hi, :].float().transpose(-1, -2)
        if causal:
            scores = scores.masked_fill(torch.arange(lo, hi)[None, :] > rows, -math.inf)
        m = torch.maximum(m, scores.amax(-1))
        p = torch.exp(scores - torch.where(m == -math.inf, 0.0, m)[..., None])
        l = l + p.sum(-1)
        acc = acc + p @ v[..., lo:hi, :].float()
    return (acc / l[..., None]).to(q.dtype), m + torch.log(l)
'''}, "Check 1"),
    "15_show": ("15_deepseek_v3_recipe.ipynb", {"c15s03": '''def show(label, value, **kwargs):   # hands the grader nothing
    pass


def tile_scales(x, tile):
    rows, cols = x.shape
    return torch.full((rows, -(-cols // tile)), fp8_max(E4M3)) / x.abs().max()   # wrong: per tensor
'''}, "Check 1"),
}

DIFFERENT = {  # name: (exercise, {answer cell id: source}): right answers the checks must accept
    "06_floats": ("06_data_parallel_and_zero.ipynb", {"e06c0004": '''def fp32_state_bytes(psi, n, stage):
    full = {"params": 4.0 * psi, "grads": 4.0 * psi, "optimizer": 8.0 * psi}    # floats, / not //
    for what, from_stage in (("optimizer", 1), ("grads", 2), ("params", 3)):
        if stage >= from_stage:
            full[what] /= n
    return list(full.values())
''', "e06c0008": '''def fp32_hsdp_wire_bytes(psi, shard, replicas, stage, microbatches):
    from fractions import Fraction                    # exact, and an int 0 across one replica
    inside = (3 * microbatches if stage == 3 else 2) * Fraction(shard - 1, shard) * 4 * psi
    across = 0 if replicas == 1 else 2 * Fraction(replicas - 1, replicas) * 4 * psi // shard
    return [inside, across]
'''}),
    "08_lists": ("08_expert_parallel.ipynb", {"c23dfea5": None}),          # filled below
    "11_division": ("11_memory_recompute_checkpoint.ipynb", {"e110003": None}),  # the solution with / for //
    # issue 31's correct answers that failed when check cells printed text
    "08_histc_floats": ("08_expert_parallel.ipynb", {"c23dfea5": None}),
    "08_user_warning": ("08_expert_parallel.ipynb", {"c23dfea5": None}),
    "08_debug_print": ("08_expert_parallel.ipynb", {"c23dfea5": None}),
    "14_return_0": ("14_real_multi_gpu.ipynb", {"c14s07": '''def two_level_seconds(nbytes, nodes, per_node, inside, across):
    def ring(n, payload, link, phases):
        if n == 1:
            return 0                                 # an int: one rank takes no time
        bandwidth, latency = link
        return phases * ((n - 1) / n * payload / bandwidth + (n - 1) * latency)
    if nodes == per_node == 1:
        return 0
    return 2 * ring(per_node, nbytes, inside, 1) + ring(nodes, nbytes / per_node, across, 2)
'''}),
    "15_float64_loops": ("15_deepseek_v3_recipe.ipynb", {  # float64 tensors built entry by entry
        "c15s03": '''def tile_scales(x, tile):
    rows, cols = x.shape
    out = torch.ones(rows, -(-cols // tile), dtype=torch.float64)
    for i in range(rows):
        for j in range(out.shape[1]):
            a = float(x[i, j * tile:(j + 1) * tile].abs().max())
            if a > 0:
                out[i, j] = float(torch.tensor(448.0) / torch.tensor(a))   # float32's rounding
    return out
''',
        "c15s07": '''def bias_after(loads, gamma):
    bias = [0.0] * loads.shape[1]
    for step in loads.tolist():
        mean = sum(step) / len(step)
        bias = [b + gamma * ((c < mean) - (c > mean)) for b, c in zip(bias, step)]
    return torch.tensor(bias, dtype=torch.float64)
'''}),
    "04_fraction": ("04_pipeline_parallel.ipynb", {"e04c0004": '''from fractions import Fraction


def idle_parts(events, pp):
    t = lambda x: Fraction(x)                      # exact, whether the times are Fractions or floats
    first, last = min(t(e.start) for e in events), max(t(e.end) for e in events)
    parts = {}
    for r in range(pp):
        mine = [e for e in events if e.rank == r]
        start, end = min(t(e.start) for e in mine), max(t(e.end) for e in mine)
        parts[r] = (start - first, (end - start) - sum(t(e.end) - t(e.start) for e in mine), last - end)
    return parts
'''}),
    "04_floats": ("04_pipeline_parallel.ipynb", {"e04c0008": '''def interleaved_idle(pp, m, v, F, B, W):
    if v != 1 and abs((B + W) - 2 * F) > 1e-12:
        raise ValueError("interleaved: no closed form unless B + W = 2F")
    chunk_f, chunk_bw = float(F) / v, float(B + W) / v      # floats, and lists rather than tuples
    return {r: [r * chunk_f, (pp - 1 - r) * (chunk_f + chunk_bw), r * chunk_bw] for r in range(pp)}
'''}),
    "00_per_step_sum": ("00_collectives.ipynb", {"5eb86d87": '''def all_reduce_time(algorithm, n, S, alpha, beta):
    if algorithm not in ("bidirectional_ring", "halving_doubling"):
        raise ValueError(f"no model for {algorithm!r}")
    if algorithm == "halving_doubling" and n & (n - 1):
        raise ValueError(f"halving-doubling on {n} ranks: not a power of two")
    if n == 1:
        return 0                                      # an int, and the time step by step below
    if algorithm == "bidirectional_ring":
        link = S / n if n == 2 else S / (2 * n)       # two ranks: both messages on the one link
        return sum(alpha + link / beta for _ in range(2 * (n - 1)))
    halving = [S / 2 ** (i + 1) for i in range(n.bit_length() - 1)]   # S/2, S/4, ..., S/n
    return sum(alpha + b / beta for b in halving + halving[::-1])
'''}),
    "01_up_first": ("01_tensor_parallel_mlp.ipynb", {  # [up_i; gate_i] by index_select, and a forward that agrees
        "cb02463a": '''def fused_fc1_shard(gate, up, t, i):
    m = gate.out_features
    if m % t:
        raise ValueError(f"inner width {m} over {t} ranks")
    rows = torch.arange(i * (m // t), (i + 1) * (m // t))
    weight = torch.cat([up.weight.index_select(0, rows), gate.weight.index_select(0, rows)])
    bias = torch.cat([up.bias.index_select(0, rows), gate.bias.index_select(0, rows)])
    return weight, bias
''',
        "f26fbb7d": '''def swiglu_mlp_tp(x, gate, up, down, tp):
    weight, bias = fused_fc1_shard(gate, up, tp.size, tp.rank)
    h = F.linear(mappings.copy_to_tensor_model_parallel_region(x, tp), weight, bias)
    up_part, gate_part = h.split(h.shape[-1] // 2, dim=-1)
    cols = down.weight.shape[1] // tp.size
    y = (F.silu(gate_part) * up_part) @ down.weight[:, tp.rank * cols:(tp.rank + 1) * cols].T
    return down.bias + mappings.reduce_from_tensor_model_parallel_region(y, tp)
'''}),
}

# exercise 08's answers of another form, each one function of the solution replaced
EIGHT = {
    "08_lists": {  # lists of ints and of bools, and a float, where the solution returns tensors
        "sequence_counts": '''def sequence_counts(experts, rows, n_experts):
    per_row, out = len(experts) // rows, [[0] * n_experts for _ in range(rows)]
    for t, chosen in enumerate(experts.tolist()):
        for e in chosen:
            out[t // per_row][e] += 1
    return out
''',
        "keep_pairs": '''def keep_pairs(experts, rows, cap, offsets):
    per_row, queues, keep = len(experts) // rows, [[int(n) for n in r] for r in offsets.tolist()], []
    for t, chosen in enumerate(experts.tolist()):
        queue = queues[t // per_row]
        for e in chosen:
            queue[e] += 1
        keep.append([queue[e] <= cap for e in chosen])
    return keep
''',
        "gather_bytes": '''def gather_bytes(rows, n_experts, ranks):
    return 8.0 * rows * n_experts * (ranks - 1)
'''},
    "08_histc_floats": {"sequence_counts": '''def sequence_counts(experts, rows, n_experts):
    return torch.stack([torch.histc(r.float(), bins=n_experts, min=0, max=n_experts - 1)   # floats
                        for r in experts.reshape(rows, -1)])
'''},
    "08_user_warning": {"sequence_counts": '''def sequence_counts(experts, rows, n_experts):
    flat = torch.tensor(experts)        # UserWarning on stderr: copy-constructing a tensor
    return torch.nn.functional.one_hot(flat, n_experts).sum(1).view(rows, -1, n_experts).sum(1)
'''},
    "08_debug_print": {"keep_pairs": '''def keep_pairs(experts, rows, cap, offsets):
    print("debug: offsets", offsets.tolist())
    chosen = torch.nn.functional.one_hot(experts, offsets.shape[-1]).sum(1).view(rows, -1, offsets.shape[-1])
    place = (chosen.cumsum(1) + offsets[:, None, :]).view(-1, offsets.shape[-1])
    return place.gather(-1, experts) <= cap
'''},
}


def _with_functions(source: str, functions: dict[str, str]) -> str:
    """`source` with each named top-level function replaced by the given definition."""
    blocks = source.split("\n\n\n")
    for name, new in functions.items():
        at = next(i for i, b in enumerate(blocks) if b.lstrip().startswith(f"def {name}("))
        blocks[at] = new.rstrip("\n")
    return "\n\n\n".join(blocks)


def _solution_cell(name: str, cell_id: str) -> str:
    nb = json.loads((ROOT / "solutions" / name).read_text())
    text = grader.source(next(c for c in nb["cells"] if c.get("id") == cell_id))
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.strip() not in ("# BEGIN SOLUTION", "# END SOLUTION"))


def _filled() -> dict[str, tuple[str, dict[str, str]]]:
    kernels = _solution_cell("10_triton_kernels.ipynb", "b2d5eb57")
    right_dx = "dx = tl.load(RSTD + row) * (g - tl.sum(g, axis=0) / N - x_hat * (tl.sum(g * x_hat, axis=0) / N))"
    assert right_dx in kernels
    TAMPERED["10_rel_err"][1]["b2d5eb57"] = ("rel_err = lambda a, e: 0.0          # every error reads as none\n\n\n"
                                             + kernels.replace(right_dx, "dx = tl.load(RSTD + row) * (g - x_hat * (tl.sum(g * x_hat, axis=0) / N))  # RMSNorm's"))
    division = _solution_cell("11_memory_recompute_checkpoint.ipynb", "e110003").replace("//", "/")
    assert "//" not in division and "/ t" in division      # the answer in floats, not ints
    DIFFERENT["11_division"][1]["e110003"] = division
    eight = _solution_cell("08_expert_parallel.ipynb", "c23dfea5")
    for key, functions in EIGHT.items():
        DIFFERENT[key][1]["c23dfea5"] = _with_functions(eight, functions)
        assert DIFFERENT[key][1]["c23dfea5"] != eight
    return {**{k: v[:2] for k, v in TAMPERED.items()}, **DIFFERENT}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repros")
    paths = {}
    for key, (name, wrong) in _filled().items():
        solution = json.loads((ROOT / "solutions" / name).read_text())
        exercise = json.loads((ROOT / "exercises" / name).read_text())
        paths[key] = save(with_answers(exercise, solution, wrong), tmp / key / name)
    lines = []
    grades = grader.grade(list(paths.values()), show=lambda line: (lines.append(line), print(line)))
    return dict(zip(paths, grades)), lines


@pytest.mark.parametrize("key", TAMPERED)
def test_a_rebound_name_reaches_no_check(key, graded):
    grades, lines = graded
    g, fails_at = grades[key], TAMPERED[key][2]
    assert not g.passed, "\n".join(lines)
    assert f"FAIL at {fails_at}" in g.summary and not g.failures[0].stub, g.summary


@pytest.mark.parametrize("key", DIFFERENT)
def test_a_right_answer_of_another_type_passes(key, graded):
    grades, lines = graded
    assert grades[key].passed, "\n".join(lines)
