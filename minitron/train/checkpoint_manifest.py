"""A checkpoint's manifest: the one file that says what a checkpoint is, and whether it is whole.

Rank 0 writes `manifest.json` last, after every shard (checkpoint.py's save), listing the model
and parallel config, the step and every shard file's size and sha256. `read_manifest` checks
all of that before a load reads a byte: a missing or truncated file, a changed checksum, a JSON
of another shape or format each raise one CheckpointError naming the file. `check_compatible`
refuses a model whose shape differs from the saved one (runtime knobs may differ).
"""
from __future__ import annotations

import dataclasses
import json
import os

from ..config import ModelConfig
from .data import sha256_file

FORMAT = 1
MANIFEST = "manifest.json"
# Fields that change how a model runs, not what its tensors are: free to differ on load.
RUNTIME_FIELDS = {"dropout", "dropout_rng", "use_kernels", "recompute", "bias_update_rate"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; the message names the file and what is wrong.
    Defined here, not beside the planners: this module imports no torch.distributed.checkpoint
    (a second of CPU), so the flags' resume checks cost python -m minitron.verify nothing."""


def write_manifest(directory: str, manifest: dict) -> None:
    """Write `manifest` into `directory`, adding every file already there with its size and
    sha256 (as "files", last), and force it to disk before the checkpoint is moved into place."""
    paths = {f: os.path.join(directory, f) for f in sorted(os.listdir(directory))}
    files = {f: {"bytes": os.path.getsize(p), "sha256": sha256_file(p)} for f, p in paths.items()}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({**manifest, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


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

