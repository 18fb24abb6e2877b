"""Distributed checkpoints that any grid can load: every tensor saved in the reference's layout.

A rank holds pieces of the reference GPT's tensors: rank r of tp holds chunk r of
`layers.0.attention.q.weight` along dim 0, pipeline rank p only its stages' layers, and under
ZeRO a data-parallel rank only 1/dp of the optimizer state. The rules of model/convert.py say
exactly which piece: for every reference tensor, a rank describes its piece by a *placement*,
(global shape, offsets of its slice). torch.distributed.checkpoint (DCP) is the storage and
resharding engine (checkpoint_planners.py hands it the placements): each rank writes its
pieces (a piece several ranks hold, a replicated norm or a dp replica's copy, is written
once, DCP's dedup), DCP's metadata records every piece's
placement, and a load at another grid asks for its own placements; DCP reads the overlapping
parts of whatever pieces were written. So tp=2, pp=2 loads at tp=1, pp=4 or tp=4, dp=2.

What is saved, under these names:
  model/<reference name>                  the weights (ZeRO-3: its shards gathered over dp)
  optimizer/{master,exp_avg,exp_avg_sq}/<reference name>   AdamW's state (ZeroOptimizer)
  manifest.json (rank 0)                  model and parallel config, step, dropout seed,
                                          optimizer step, caller's extra (data position,
                                          loss scale), the experts' biases (checkpoint_bias.py),
                                          and every file's size and sha256
ZeRO's flat shards do not map to rectangles of the reference tensors, so before saving each
rank's optimizer shard is put back into whole tp-local tensors (one all-reduce over the
sharding group, data_parallel/checks.py's way); loading cuts the owned elements out again. The
ZeRO stage and dp can therefore change between save and load. Expert tensors are stacked
[E, ...]: ep rank e holds experts [e E/ep, (e+1) E/ep) (dim 0), and tp splits each inside as
convert.py's rules say, so a mixture-of-experts model saved at ep=2 loads at ep=4 or ep=1.

A save is atomic: everything goes to `<path>.partial`, rank 0 writes the manifest last and
renames the directory to `<path>` (one rename; DCP's FileSystemWriter already assumes a file
system all ranks share). A rank killed mid-save leaves a `.partial` without a manifest, and the
previous checkpoint untouched. A load checks the manifest, the model and every file's size and
checksum before it reads a byte into the model: a bad checkpoint changes nothing.
DCP's own plan exchange talks through torch.distributed directly, not minitron.runtime.comm (uncounted).

This file is the save and the load; the manifest (its format and checks) is in
checkpoint_manifest.py, the FP8 scalers' state in checkpoint_fp8.py, the experts' biases in
checkpoint_bias.py, the placements in checkpoint_pieces.py, DCP's planners in
checkpoint_planners.py. Their public names are importable from here too.
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

from ..runtime import comm
from .checkpoint_bias import biases_of_every_stage, load_biases
from .checkpoint_fp8 import fp8_states_of_every_stage, load_fp8  # noqa: F401 (checkpoint.load_fp8)
from .checkpoint_manifest import (FORMAT, MANIFEST, RUNTIME_FIELDS,  # noqa: F401 (re-exported)
                                  CheckpointError, check_compatible, read_manifest, write_manifest)
from .checkpoint_pieces import (_local_to_state, _state_to_local, _write_weights, local_weights,
                                placements)
from .checkpoint_planners import PlacedLoadPlanner, PlacedSavePlanner

STATES = ("master", "exp_avg", "exp_avg_sq")


# ---- save ------------------------------------------------------------------------------------
def _world(grid) -> comm.Group:
    return comm.Group("world", range(grid.world_size))


def save(path: str, model, engine=None, optimizer=None, *, step: int = 0, extra: dict | None = None) -> None:
    """Every rank calls it (collective). `engine`/`optimizer`: data_parallel.wrap's pair, or None.
    `extra` (JSON-able, rank 0's is kept): e.g. the data position and the loss scaler's state."""
    grid = model.grid
    if optimizer is not None and engine is None:
        raise ValueError("checkpoint.save: the optimizer's state is sharded by its engine; pass "
                         "engine= too (data_parallel.wrap returns both)")
    path = os.path.abspath(path)
    partial = path + ".partial"
    placed = placements(local_weights(model, engine), model, "model/")
    if optimizer is not None:
        for kind, flat in _optimizer_flats(optimizer):
            placed.update(placements(_state_to_local(engine, flat), model, f"optimizer/{kind}/"))
    _refuse_non_finite(placed, grid, path)
    fp8, biases = fp8_states_of_every_stage(model), biases_of_every_stage(model)   # over pp
    if grid.rank == 0:
        if os.path.exists(partial):
            shutil.rmtree(partial)        # left by a save that died
        os.makedirs(partial)
    comm.barrier(_world(grid))
    dcp.save({k: v[0] for k, v in placed.items()}, planner=PlacedSavePlanner(placed),
             storage_writer=dcp.FileSystemWriter(partial, single_file_per_rank=True))
    comm.barrier(_world(grid))
    if grid.rank == 0:
        manifest = {"format": FORMAT, "model": dataclasses.asdict(model.cfg),
                    "parallel": dataclasses.asdict(grid.config), "step": step,
                    "dropout_seed": model.rng.seed, "dtype": str(next(model.parameters()).dtype),
                    "zero_stage": _zero_stage(engine),
                    "optimizer_step": optimizer.step_count if optimizer is not None else None,
                    "optimizer_states": [k for k, _ in _optimizer_flats(optimizer)] if optimizer else [],
                    "extra": extra or {}, "fp8": fp8, "expert_bias": biases}
        write_manifest(partial, manifest)
        old = path + ".old"
        if os.path.exists(path):
            os.rename(path, old)          # keep the previous one until the new one is in place
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    comm.barrier(_world(grid))


def _refuse_non_finite(placed: dict, grid, path: str) -> None:
    """A diverged run must not replace a good checkpoint: CheckpointError on every rank (the
    verdict is all-reduced) when any rank's weights or optimizer state hold a NaN or an inf."""
    bad = [name for name, (t, _, _) in placed.items() if not torch.isfinite(t).all()]
    flag = torch.tensor([float(bool(bad))], device=next(iter(placed.values()))[0].device)
    if comm.all_reduce(flag, _world(grid))[0] > 0:
        where = f"on this rank: {', '.join(bad[:3])}" if bad else "on another rank"
        raise CheckpointError(f"refusing to save {path}: non-finite values (NaN or inf) {where}")


def _zero_stage(engine):
    if engine is None:
        return None
    return engine.zero_stage


def _optimizer_flats(optimizer) -> list[tuple[str, torch.Tensor]]:
    out = [] if optimizer.master_is_model else [("master", optimizer.master)]
    return out + [("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)]


# ---- load ------------------------------------------------------------------------------------
def _dcp_read(path: str, wanted: dict) -> None:
    try:
        dcp.load({k: v[0] for k, v in wanted.items()}, planner=PlacedLoadPlanner(wanted, path),
                 storage_reader=dcp.FileSystemReader(path))
    except CheckpointError:
        raise
    except Exception as e:                 # DCP wraps every rank's failure; name the checkpoint
        raise CheckpointError(f"{path}: reading the shards failed: {str(e).splitlines()[0]}") from None


@torch.no_grad()
def load(path: str, model, engine=None, optimizer=None) -> dict:
    """Load `path` into this rank's model (and optimizer), whatever grid saved it; returns the
    manifest (step, extra, ...). Collective. Nothing is changed unless every check passes."""
    path = os.path.abspath(path)
    manifest = read_manifest(path)
    check_compatible(manifest, model.cfg, path)
    if optimizer is not None and engine is None:
        raise ValueError("checkpoint.load: pass the optimizer's engine= too")
    if optimizer is not None and manifest["optimizer_step"] is None:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: saved without optimizer state; "
                              "load the weights only (optimizer=None)")
    weights = {n: torch.empty_like(t) for n, t in local_weights(model, engine).items()}
    wanted = placements(weights, model, "model/")
    states, masters = {}, None
    if optimizer is not None:
        shapes = {engine.names[p]: p for p in engine.parameters}
        fp32 = {k: {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in shapes.items()}
                for k in STATES}
        for kind in STATES[1:]:
            states[kind] = fp32[kind]
            wanted.update(placements(fp32[kind], model, f"optimizer/{kind}/"))
        if not optimizer.master_is_model:
            masters = fp32["master"]
            saved_master = "master" in manifest["optimizer_states"]
            # An fp32 run's weights were its own masters: read them in full precision.
            source = "optimizer/master/" if saved_master else "model/"
            _dcp_read(path, placements(masters, model, source))
    _dcp_read(path, wanted)
    # Every check passed and every byte is read: only now change the model and optimizer.
    load_biases(model, manifest.get("expert_bias"), path)      # checks its shape first
    _write_weights(model, engine, weights)
    model.rng.seed = manifest["dropout_seed"]   # masks are keyed by (seed, step, layer, row)
    load_fp8(model, manifest.get("fp8"), path)
    if optimizer is not None:
        for kind, flat in _optimizer_flats(optimizer):
            _local_to_state(engine, masters if kind == "master" else states[kind], flat)
        optimizer.step_count = manifest["optimizer_step"]
    return manifest
