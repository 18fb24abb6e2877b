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
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

from ..config import ModelConfig
from ..runtime import comm
from ..tensor_parallel.fp8_linear import SCALERS, named_fp8_states
from .checkpoint_bias import biases_of_every_stage, load_biases
from .checkpoint_pieces import (_local_to_state, _state_to_local, _write_weights, local_weights,
                                placements)
from .checkpoint_planners import CheckpointError, PlacedLoadPlanner, PlacedSavePlanner
from .data import sha256_file

FORMAT = 1
MANIFEST = "manifest.json"
STATES = ("master", "exp_avg", "exp_avg_sq")
# Fields that change how a model runs, not what its tensors are: free to differ on load.
RUNTIME_FIELDS = {"dropout", "dropout_rng", "use_kernels", "recompute", "bias_update_rate"}


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
        paths = {f: os.path.join(partial, f) for f in sorted(os.listdir(partial))}
        files = {f: {"bytes": os.path.getsize(p), "sha256": sha256_file(p)} for f, p in paths.items()}
        manifest = {"format": FORMAT, "model": dataclasses.asdict(model.cfg),
                    "parallel": dataclasses.asdict(grid.config), "step": step,
                    "dropout_seed": model.rng.seed, "dtype": str(next(model.parameters()).dtype),
                    "zero_stage": _zero_stage(engine),
                    "optimizer_step": optimizer.step_count if optimizer is not None else None,
                    "optimizer_states": [k for k, _ in _optimizer_flats(optimizer)] if optimizer else [],
                    "extra": extra or {}, "fp8": fp8, "expert_bias": biases, "files": files}
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
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
# ---- FP8: the scalers' amax histories, scales and uses (tensor_parallel/fp8.py) -----------------
# With the amaxes reduced over tp x cp x ep x dp every rank holding a layer holds the same scaler
# state, so one copy per layer, taken over the pipeline's stages, is the checkpoint's (in the
# manifest: float32 values survive JSON exactly). Without the reduction (--no-fp8-amax-reduce)
# each rank's differs, and the copy kept is that of the stage's first ranks. An expert's scalers
# (tensor_parallel/fp8_batched.py) live on its ep rank alone: they are taken over ep too.
def _fp8_layout(model) -> list[tuple[str, int]]:
    """(FP8 layer, scaler) of the whole model, stage by stage, from the config (every rank
    agrees, whatever it holds): layers.{i}.attention.qkv / .out, layers.{i}.mlp.fc1 / .fc2, and
    in an MoE layer layers.{i}.mlp.experts.{gate, fc1, fc2}.{e}, expert by expert."""
    cfg, parts = model.cfg, ("gate", "fc1", "fc2") if model.cfg.activation == "swiglu" else ("fc1", "fc2")
    gemms = lambda i: ["attention.qkv", "attention.out"] + ([f"mlp.experts.{p}.{e}" for p in parts for e in
                       range(cfg.n_experts)] if cfg.is_moe_layer(i) else ["mlp.fc1", "mlp.fc2"])
    return [(f"layers.{i}.{g}", k) for i in range(cfg.n_layers) for g in gemms(i) for k in range(len(SCALERS))]


def fp8_states_of_every_stage(model) -> dict | None:
    """{layer: {scaler: {"history", "scale", "uses"}}} of every FP8 layer (collective over pp, ep),
    None without FP8."""
    mine = named_fp8_states(model)
    recipes = [s.recipe for s in mine.values()]
    if not recipes:
        return None
    width = 2 + recipes[0].history_len      # uses, scale, history...
    layout = _fp8_layout(model)
    flat = torch.zeros(len(layout), width, device=model.grid.device)
    for row, (name, k) in enumerate(layout):
        if name in mine and (".experts." in name or model.grid.ep.rank == 0):  # one copy over ep
            st = mine[name].scalers()[k]
            flat[row, 0] = float(st.uses)
            if st.scale is not None:
                flat[row, 1] = st.scale
            if st.history is not None:
                flat[row, 2:] = st.history
    comm.all_reduce(comm.all_reduce(flat, model.grid.pp, op="max"), model.grid.ep, op="max")
    out: dict = {}
    for row, (name, k) in zip(flat.tolist(), layout):
        uses, scale, history = row[0], row[1], row[2:]
        out.setdefault(name, {})[SCALERS[k]] = {
            "uses": int(uses), "scale": scale if scale > 0 else None,
            "history": history if uses > 0 or any(history) else None}
    return out


def load_fp8(model, saved: dict | None, path: str) -> None:
    mine = named_fp8_states(model)
    if not mine:
        return
    if saved is None:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: saved without FP8 scaler state "
                              "(not an FP8 run): a resumed FP8 run would start every amax history "
                              "empty; resume it with the --dtype it was saved with")
    device = model.grid.device
    tensor = lambda v: None if v is None else torch.tensor(v, dtype=torch.float32, device=device)
    for name, state in mine.items():
        for k, scaler in zip(SCALERS, state.scalers()):
            s = saved[name][k]
            scaler.load_state_dict({"history": tensor(s["history"]), "scale": tensor(s["scale"]),
                                    "uses": s["uses"]})


def read_manifest(path: str) -> dict:
    """The manifest, after checking that every file it lists is there, whole and unchanged."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint (a save "
                              "that was interrupted leaves none)")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}") from None
    _check_shape(manifest, file)
    for name, want in manifest["files"].items():
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise CheckpointError(f"{f} is missing (the manifest lists it)")
        if os.path.getsize(f) != want["bytes"]:
            raise CheckpointError(f"{f} has {os.path.getsize(f)} bytes, the manifest says "
                                  f"{want['bytes']}: truncated or overwritten")
        if sha256_file(f) != want["sha256"]:
            raise CheckpointError(f"{f} is corrupted: its sha256 differs from the manifest's")
    return manifest


# What load reads from a manifest: key -> the types its value may have.
_FIELDS = {"model": dict, "step": int, "dropout_seed": int, "optimizer_step": (int, type(None)),
           "optimizer_states": list, "extra": dict, "files": dict}


def _check_shape(manifest, file: str) -> None:
    """CheckpointError naming the file unless the JSON is a manifest of this format: valid JSON
    of another shape (a list, a missing key) is as unreadable as a corrupt file."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file} is not a minitron manifest: a JSON "
                              f"{type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r}, this minitron reads {FORMAT}")
    wrong = [k for k, kinds in _FIELDS.items() if k not in manifest
             or not isinstance(manifest[k], kinds) or isinstance(manifest[k], bool)]
    files = manifest.get("files")
    if isinstance(files, dict):
        wrong += [f"files[{n!r}]" for n, f in files.items()
                  if n != os.path.basename(n) or not isinstance(f, dict)
                  or not isinstance(f.get("bytes"), int) or not isinstance(f.get("sha256"), str)]
    if wrong:
        raise CheckpointError(f"{file} is not a minitron manifest: missing or malformed "
                              + ", ".join(wrong))


def check_compatible(manifest: dict, cfg: ModelConfig, path: str) -> None:
    saved = manifest["model"]
    wrong = [f"{k}={saved.get(k)!r} (this model: {v!r})" for k, v in dataclasses.asdict(cfg).items()
             if k not in RUNTIME_FIELDS and saved.get(k) != v]
    if wrong:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: saved from an incompatible model: "
                              + ", ".join(wrong))


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
