"""FP8 scaler state in a checkpoint: the amax histories, scales and uses (tensor_parallel/fp8.py).

With the amaxes reduced over tp x cp x ep x dp every rank holding a layer holds the same scaler
state, so one copy per layer, taken over the pipeline's stages, is the checkpoint's (in the
manifest: float32 values survive JSON exactly). Without the reduction (--no-fp8-amax-reduce)
each rank's differs, and the copy kept is that of the stage's first ranks. An expert's scalers
(tensor_parallel/fp8_batched.py) live on its ep rank alone: they are taken over ep too.
"""
from __future__ import annotations

import os

import torch

from ..runtime import comm
from ..tensor_parallel.fp8_linear import SCALERS, named_fp8_states
from .checkpoint_manifest import MANIFEST, CheckpointError


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
