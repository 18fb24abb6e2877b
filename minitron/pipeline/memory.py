"""Measuring the activation memory a pipeline schedule keeps alive, on the real model.

Activations are what autograd saves for backward. Every tensor saved while a (micro-batch,
stage) runs its forward is recorded (torch.autograd.graph.saved_tensors_hooks) under that key,
by storage, without the parameters and the step's input batch. A key's activations are alive
while any of its saved storages is: the graph holds them until B or BW frees it, and after B
the deferred weight-gradient closures still hold each linear layer's input until W
(tensor_parallel/weight_grad.py; the output gradients those closures hold are counted too).
Liveness is read from weak references, not from bookkeeping: a tensor counts only while
something really holds it.

`sample()` after every action records the peak of both measures: bytes alive, and the number
of keys alive, which the schedule checker predicts (micro-batches in flight per rank).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Hashable, Iterable

import torch

from ..tensor_parallel.weight_grad import STORE


class ActivationMemory:
    def __init__(self, excluded: Iterable[torch.Tensor]):
        # parameters and inputs live for the whole step: they are not activations
        self.excluded = {t.untyped_storage().data_ptr() for t in excluded}
        self.saved: dict[Hashable, dict[int, tuple[list, int]]] = {}  # key -> storage -> (refs, bytes)
        self.unit_bytes: dict[Hashable, int] = {}     # bytes each key saved in its forward
        self.peak_bytes = 0
        self.peak_alive = 0

    @contextlib.contextmanager
    def recording(self, key: Hashable):
        """Attribute every tensor saved for backward inside to `key`."""
        storages = self.saved.setdefault(key, {})

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.excluded and storage.nbytes() > 0:
                refs, nbytes = storages.setdefault(ptr, ([], storage.nbytes()))
                refs.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.unit_bytes[key] = sum(n for _, n in storages.values())

    def alive(self) -> tuple[int, int]:
        """(bytes alive, keys alive) now; forgets keys whose activations are all freed."""
        total, keys = STORE.pending_bytes(), 0
        for key in list(self.saved):
            live = sum(n for refs, n in self.saved[key].values() if any(r() is not None for r in refs))
            if live == 0:
                del self.saved[key]
                continue
            total, keys = total + live, keys + 1
        return total, keys

    def sample(self) -> None:
        nbytes, keys = self.alive()
        self.peak_bytes, self.peak_alive = max(self.peak_bytes, nbytes), max(self.peak_alive, keys)
