"""The replicas rows: tensors a group holds whole must stay bitwise identical across it.

A parameter that a group holds whole (norm weights, row-parallel biases and learned
positions on the tensor-parallel group; later every parameter on the data- and context-
parallel groups, and the tied embedding on the pipeline's embedding group) must stay bitwise
identical across that group, gradients and weights alike, or the ranks train different
models. `replica_rows` all-gathers them (counted, through minitron.runtime.comm) and compares bytes.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..grid import Grid
from ..model.convert import Rule, rules
from ..runtime import comm
from .compare import rel_err
from .report import Row


def replica_groups(rule: Rule, tied_across_stages: bool = False, over_dp: bool = True) -> list[str]:
    """The groups across which this parameter is held whole (and must stay identical).

    Not split along tp: replicated over tp. Every parameter is replicated over dp and cp (data
    and context parallelism copy the model), and every one but the experts' over ep (an
    expert-parallel rank holds other experts, but is a data-parallel replica of the dense
    layers); groups of one rank are skipped by the caller.
    A pipeline's tied word embedding, when the first and the last stage are on different ranks
    (both hold a copy: model/stages.py), is replicated over the "embedding"
    group. over_dp=False leaves dp out: tensors rebuilt from ZeRO shards (data_parallel.checks)
    are equal over their shard group by construction, so comparing them there would check
    nothing; across dp_replicate (HSDP) each copy is rebuilt apart, and compared.
    """
    groups = ["dp", "cp"] if over_dp else ["dp_replicate", "cp"]   # HSDP: rebuilt per shard group
    if over_dp and not rule.experts:   # an ep rank is a data-parallel replica of dense layers
        groups.append("ep")
    if rule.dim is None:
        groups.insert(0, "tp")
    if tied_across_stages and rule.name == "embedding.word.weight":
        groups.append("embedding")
    return groups


def replica_rows(step: int, kind: str, local: dict, cfg: ModelConfig, grid: Grid,
                 tied_across_stages: bool = False, over_dp: bool = True) -> list[Row]:
    """All-gather every replicated tensor over its group and compare bitwise (collective).

    One row: err = the largest relative difference between two copies (0 when identical),
    tol = 0, and the first offending tensor and ranks in `detail`. `local` may hold only some
    of the rules' tensors (a pipeline rank's stages): every rank in a group holds the same.
    """
    by_group: dict[str, list[str]] = {}
    for rule in rules(cfg):
        if rule.name in local:
            for g in replica_groups(rule, tied_across_stages, over_dp):
                if grid.groups[g].size > 1:
                    by_group.setdefault(g, []).append(rule.name)
    worst, detail = 0.0, ""
    for g, names in by_group.items():
        group = grid.groups[g]
        flat = torch.cat([local[n].detach().reshape(-1) for n in names])
        copies = comm.all_gather(flat.unsqueeze(0).contiguous(), group, dim=0)   # [size, numel]
        offset = 0
        for n in names:
            piece = copies[:, offset:offset + local[n].numel()]
            offset += local[n].numel()
            for r in range(1, group.size):
                if torch.equal(piece[r].view(torch.uint8), piece[0].view(torch.uint8)):
                    continue
                err = rel_err(piece[r], piece[0])
                err = err if err > 0 else math.inf       # differ in bits only (NaN payload, -0.0)
                if not detail or err > worst:
                    worst = err
                    detail = (f"{kind[:-1]} {n} differs between {g} ranks 0 and {r} (global ranks "
                              f"{group.global_rank(0)} and {group.global_rank(r)}): "
                              f"max rel diff {err:.2e}")
    return [Row(step, f"replicas {kind}", worst, 0.0, detail)]
