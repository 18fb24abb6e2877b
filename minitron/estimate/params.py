"""How many parameters one rank holds: its pipeline stages' tensors, split over tp (and the
experts over ep), counted from the reference GPT's shapes without building it."""
from __future__ import annotations

import functools
import re

import torch

from ..config import ModelConfig
from ..model.convert import stage_rules
from ..model.reference import Block, make_norm
from .shape import expert_ffn, mlp_matrices, shared_experts


@functools.lru_cache(maxsize=64)
def _shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every reference tensor's shape, from modules built on the meta device (no memory)."""
    with torch.device("meta"):
        block, norm = Block(cfg), make_norm(cfg)
        moe_block = Block(cfg, moe=True) if cfg.n_experts else None
    shapes = {f"block.{k}": v.shape for k, v in block.state_dict().items()}
    if moe_block is not None:
        shapes |= {f"moe_block.{k}": v.shape for k, v in moe_block.state_dict().items()}
    shapes |= {f"final_norm.{k}": v.shape for k, v in norm.state_dict().items()}
    # nn.Embedding's normal_ init is slow to set up on meta: its two tables, by hand
    shapes["embedding.word.weight"] = torch.Size((cfg.vocab_size, cfg.hidden))
    shapes["embedding.position.weight"] = torch.Size((cfg.seq_len, cfg.hidden))
    shapes["lm_head.weight"] = torch.Size((cfg.vocab_size, cfg.hidden))
    return shapes


def _block_key(cfg: ModelConfig, name: str) -> str:
    """layers.<i>.rest -> block.rest, or moe_block.rest for a MoE layer."""
    m = re.match(r"^layers\.(\d+)\.", name)
    if not m:
        return name
    kind = "moe_block." if cfg.n_experts and cfg.is_moe_layer(int(m.group(1))) else "block."
    return kind + name[m.end():]


@functools.lru_cache(maxsize=1024)
def rank_params_split(cfg: ModelConfig, tp: int = 1, pp: int = 1, virtual: int = 1,
                      pp_rank: int = 0, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters pipeline rank `pp_rank` holds on one tp and ep rank."""
    n_stages = pp * virtual
    stages = [s for s in range(n_stages) if s % pp == pp_rank]     # interleaved placement
    shapes, dense, expert = _shapes(cfg), 0, 0
    for rule in stage_rules(cfg, stages, n_stages):
        numel = sum(shapes[_block_key(cfg, p)].numel() for p in rule.parts)
        numel = numel if rule.dim is None else numel // tp
        if getattr(rule, "experts", False):
            expert += numel // ep
        else:
            dense += numel
    if expert_ffn(cfg) != cfg.ffn or shared_experts(cfg):   # shapes minitron's MoE does not build
        moe_layers = sum(cfg.is_moe_layer(i) for s in stages for i in _stage_layers(cfg, s, n_stages))
        expert = expert * expert_ffn(cfg) // cfg.ffn
        dense += moe_layers * shared_experts(cfg) * mlp_matrices(cfg) * cfg.hidden * expert_ffn(cfg) // tp
    return dense, expert


def _stage_layers(cfg: ModelConfig, stage: int, n_stages: int) -> range:
    per = cfg.n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


def rank_params(cfg: ModelConfig, tp: int = 1, pp: int = 1, virtual: int = 1, pp_rank: int = 0,
                ep: int = 1) -> int:
    """Parameters pipeline rank `pp_rank` holds on one tp (and ep) rank (its stages' shards)."""
    return sum(rank_params_split(cfg, tp, pp, virtual, pp_rank, ep))
