"""Reference state dict <-> one tensor-parallel rank's state dict, both ways, exactly.

Every parameter of ParallelGPT is described by one `Rule`: its name, the reference tensors
it is made of, and the dimension along which they are split (None: replicated).

  rank r's tensor = cat_k( chunk_r(reference part k, along dim) , along dim )

One part is a plain split (embedding rows, a Linear's output or input features); several
parts are a fused layout: attention.qkv = [q_r; k_r; v_r] and, for SwiGLU,
mlp.fc1 = [gate_r; up_r]. Gathering inverts it: all-gather along dim, cut each rank's block
back into its parts, and concatenate each part's pieces in rank order (the all-gathers of all
split tensors are made as one, of them flattened side by side: the same bytes in one call).

Expert weights (a mixture-of-experts block, minitron/moe/) are stacked [E, ...]; their rules
say `experts=True`: expert parallelism first cuts dim 0 (expert e on ep rank e // (E/ep)),
then tp splits inside each expert along `dim` as for the dense MLP. Gathering undoes it: the tp
all-gather, then one all-gather over ep along dim 0.

Rules for the blocks are built per layer (`layer_rules(i, ...)`), so a pipeline stage asks for
the rules of its own layers only (`stage_rules`), and gathering works across stages too.
"""
from __future__ import annotations

import dataclasses

import torch

from ..runtime import comm
from ..grid import Grid
from ..moe.experts import TP_DIM as EXPERT_TP_DIM
from ..config import ModelConfig
from .reference import Block, make_norm


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str                      # key in ParallelGPT's state dict
    parts: tuple[str, ...]         # keys in the reference GPT's state dict
    dim: int | None                # split dimension; None = replicated on every tp rank
    sizes: tuple[int, ...] = ()    # fused parts only: each part's full size along dim
    experts: bool = False          # stacked expert tensor: dim 0 split across ep first


def _linear(cfg: ModelConfig, name: str, parts: tuple[str, ...], dim: int,
            sizes: tuple[int, ...] = ()) -> list[Rule]:
    """A Linear's weight rule and, when cfg.bias, its bias rule: split with a column-parallel
    weight (dim 0), whole with a row-parallel one (dim 1: added once, after the sum)."""
    rules = [Rule(f"{name}.weight", tuple(f"{p}.weight" for p in parts), dim, sizes)]
    if cfg.bias:
        rules.append(Rule(f"{name}.bias", tuple(f"{p}.bias" for p in parts),
                          0 if dim == 0 else None, sizes))
    return rules


def _norm(cfg: ModelConfig, name: str) -> list[Rule]:
    keys = ("weight",) if cfg.norm == "rmsnorm" else ("weight", "bias")
    return [Rule(f"{name}.{k}", (f"{name}.{k}",), None) for k in keys]


def _moe(cfg: ModelConfig, mlp: str) -> list[Rule]:
    """A mixture of experts: the router replicated, every expert tensor split over ep and tp."""
    keys = [k for k in EXPERT_TP_DIM if cfg.activation == "swiglu" or not k.startswith("gate")]
    keys = [k for k in keys if cfg.bias or not k.endswith("bias")]
    return [Rule(f"{mlp}.router.weight", (f"{mlp}.router.weight",), None),
            *(Rule(f"{mlp}.experts.{k}", (f"{mlp}.experts.{k}",), EXPERT_TP_DIM[k], experts=True)
              for k in keys)]


def layer_rules(i: int, cfg: ModelConfig) -> list[Rule]:
    """The rules of block i (same index on both sides)."""
    pre = f"layers.{i}"
    att, mlp = f"{pre}.attention", f"{pre}.mlp"
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if cfg.is_moe_layer(i):
        mlp_rules = _moe(cfg, mlp)
    elif cfg.activation == "swiglu":
        mlp_rules = [*_linear(cfg, f"{mlp}.fc1", (f"{mlp}.gate", f"{mlp}.fc1"), 0, (cfg.ffn, cfg.ffn)),
                     *_linear(cfg, f"{mlp}.fc2", (f"{mlp}.fc2",), 1)]
    else:
        mlp_rules = [*_linear(cfg, f"{mlp}.fc1", (f"{mlp}.fc1",), 0),
                     *_linear(cfg, f"{mlp}.fc2", (f"{mlp}.fc2",), 1)]
    return [*_norm(cfg, f"{pre}.attn_norm"),
            *_linear(cfg, f"{att}.qkv", (f"{att}.q", f"{att}.k", f"{att}.v"), 0, (q, kv, kv)),
            *_linear(cfg, f"{att}.out", (f"{att}.out",), 1),
            *_norm(cfg, f"{pre}.mlp_norm"),
            *mlp_rules]


def stage_layers(cfg: ModelConfig, stage: int, n_stages: int) -> range:
    """The blocks of pipeline stage `stage` of `n_stages` (equal chunks, in model order)."""
    if cfg.n_layers % n_stages:
        raise ValueError(f"n_layers={cfg.n_layers} cannot be cut into {n_stages} equal pipeline "
                         f"stages: choose a layer count divisible by pp*virtual={n_stages}")
    per = cfg.n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


def stage_rules(cfg: ModelConfig, stages, n_stages: int) -> list[Rule]:
    """The parameters of a set of pipeline stages, in rules(cfg)'s order.

    Stage 0 holds the embedding; the last stage the final norm and the output layer. With tied
    embeddings the last stage, when it is not also stage 0, keeps its own copy of the word
    embedding under the same name (its gradient is summed with stage 0's: model/parallel.py).
    """
    stages, last = set(stages), n_stages - 1
    out = []
    if 0 in stages or (last in stages and cfg.tie_embeddings):
        out.append(Rule("embedding.word.weight", ("embedding.word.weight",), 0))
    if 0 in stages and cfg.position == "learned":
        out.append(Rule("embedding.position.weight", ("embedding.position.weight",), None))
    for s in sorted(stages):
        for i in stage_layers(cfg, s, n_stages):
            out += layer_rules(i, cfg)
    if last in stages:
        out += _norm(cfg, "final_norm")
        if not cfg.tie_embeddings:
            out.append(Rule("lm_head.weight", ("lm_head.weight",), 0))
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every parameter of ParallelGPT, in a fixed order (gathering is collective)."""
    return stage_rules(cfg, [0], 1)


def _my_rules(cfg: ModelConfig, grid: Grid, placement) -> list[Rule]:
    if placement is None:                       # one stage: the whole model on every rank
        return rules(cfg)
    return stage_rules(cfg, [s for s, r in enumerate(placement) if r == grid.pp_rank], len(placement))


def shard_state_dict(full_sd: dict, cfg: ModelConfig, grid: Grid, placement=None) -> dict:
    """This rank's ParallelGPT state dict cut from a reference GPT state dict (no communication).

    `placement` (pipeline stage -> pipeline rank, see pipeline/actions.py): keep only the
    parameters of this rank's stages. None: the whole model."""
    tp, r = grid.tp.size, grid.tp.rank
    local = {}
    for rule in _my_rules(cfg, grid, placement):
        parts = [full_sd[p] for p in rule.parts]
        if rule.experts:                        # this ep rank's experts
            parts = [t.chunk(grid.ep.size, 0)[grid.ep.rank] for t in parts]
        if rule.dim is None:
            local[rule.name] = parts[0].clone()
        else:
            local[rule.name] = torch.cat([t.chunk(tp, rule.dim)[r] for t in parts], rule.dim).clone()
    return local


def _gather_blocks(tensors: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """[tensor][rank]: each rank's tensor in the same place of the list (every rank of the group
    holds the same shapes), by one all-gather per dtype of them all flattened side by side: the
    same bytes as one all-gather per tensor, in a few collectives instead of hundreds."""
    n = group.size
    if n == 1:
        return [[t] for t in tensors]
    blocks: list = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        sizes = [tensors[i].numel() for i in idx]
        ranks = comm.all_gather(torch.cat([tensors[i].reshape(-1) for i in idx]), group).chunk(n)
        per_rank = [r.split(sizes) for r in ranks]
        for k, i in enumerate(idx):
            blocks[i] = [per_rank[r][k].view(tensors[i].shape) for r in range(n)]
    return blocks


def _gather_tp(local_sd: dict, rule_list: list[Rule], grid: Grid) -> dict:
    """Reference-layout tensors of `rule_list`, from this tp group's shards (collective over tp,
    and over ep for expert tensors)."""
    split = [rule for rule in rule_list if rule.dim is not None]
    blocks = dict(zip((rule.name for rule in split),      # [rank]: each tp rank's shard
                      _gather_blocks([local_sd[rule.name] for rule in split], grid.tp)))
    full = {}
    for rule in rule_list:
        t = local_sd[rule.name]
        if rule.experts:                         # tp pieces, then the ep ranks' experts
            if rule.dim is not None:
                t = torch.cat(blocks[rule.name], rule.dim)
            # clone: with ep = tp = 1 the gather returns the live tensor itself
            full[rule.parts[0]] = comm.all_gather(t.contiguous(), grid.ep, dim=0).clone()
            continue
        if rule.dim is None:
            full[rule.parts[0]] = t.clone()
            continue
        sizes = [n // grid.tp.size for n in rule.sizes] if rule.sizes else [t.shape[rule.dim]]
        pieces = [b.split(sizes, rule.dim) for b in blocks[rule.name]]          # [rank][part]
        for k, name in enumerate(rule.parts):
            full[name] = torch.cat([piece[k] for piece in pieces], rule.dim)
    return full


def gather_state_dict(local_sd: dict, cfg: ModelConfig, grid: Grid, placement=None) -> dict:
    """The reference-layout state dict, assembled on every rank.

    Works for any dict with ParallelGPT's keys: weights, or their gradients. One all-gather over
    tp of every split tensor at once (per dtype); with a pipeline `placement`, then one
    broadcast per pipeline rank over pp of everything that rank holds (a tensor two stages
    hold, the tied embedding, is sent once, by stage 0's rank).
    """
    if placement is None:
        return _gather_tp(local_sd, rules(cfg), grid)
    mine = _gather_tp(local_sd, _my_rules(cfg, grid, placement), grid)
    shapes = reference_shapes(cfg)
    dtype = next(iter(local_sd.values())).dtype
    owner: dict[str, int] = {}                    # reference name -> the first pp rank holding it
    for pp_rank in range(grid.pp.size):
        stages = [s for s, r in enumerate(placement) if r == pp_rank]
        for rule in stage_rules(cfg, stages, len(placement)):
            for name in rule.parts:
                owner.setdefault(name, pp_rank)
    full = {}
    for pp_rank in range(grid.pp.size):
        names = [n for n, r in owner.items() if r == pp_rank]
        if pp_rank == grid.pp.rank:
            flat = torch.cat([mine[n].reshape(-1) for n in names])
        else:
            flat = torch.empty(sum(shapes[n].numel() for n in names), dtype=dtype, device=grid.device)
        comm.broadcast(flat, grid.pp, src=pp_rank)
        for n, piece in zip(names, flat.split([shapes[n].numel() for n in names])):
            full[n] = piece.view(shapes[n])
    return {p: full[p] for rule in rules(cfg) for p in rule.parts}


def reference_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The reference GPT's parameter shapes, from modules built on the meta device (no memory)."""
    # The embedding's tables by hand: nn.Embedding's normal_ init on meta imports torch._dynamo
    # (seconds of CPU in every launched rank that saves or loads a checkpoint)
    shapes = {"embedding.word.weight": torch.Size([cfg.vocab_size, cfg.hidden])}
    if cfg.position == "learned":
        shapes["embedding.position.weight"] = torch.Size([cfg.seq_len, cfg.hidden])
    with torch.device("meta"):
        blocks = {moe: {k: v.shape for k, v in Block(cfg, moe).state_dict().items()}
                  for moe in {cfg.is_moe_layer(i) for i in range(cfg.n_layers)}}
        shapes.update({f"layers.{i}.{k}": v for i in range(cfg.n_layers)
                       for k, v in blocks[cfg.is_moe_layer(i)].items()})
        shapes.update({f"final_norm.{k}": v.shape for k, v in make_norm(cfg).state_dict().items()})
        if not cfg.tie_embeddings:
            shapes["lm_head.weight"] = torch.Size([cfg.vocab_size, cfg.hidden])
    return shapes


def grads_state_dict(model: torch.nn.Module) -> dict:
    """{name: grad} for every parameter that has one, keyed like the model's state dict."""
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
