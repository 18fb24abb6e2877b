"""Measuring what context parallelism costs a rank: saved activations, peak memory, traffic.

Two memory measures, both on any device (no CUDA allocator statistics needed):

  saved_bytes   what autograd keeps for backward while the graph lives (the activations),
                recorded by torch.autograd.graph.saved_tensors_hooks, each storage once;
  PeakBytes     the most bytes alive at once of every tensor created inside the block
                (forward and backward, temporaries and messages included): a dispatch mode
                sees each operation's outputs, and liveness is read from weak references
                (a storage is alive while any tensor viewing it is). Over gloo the peak can
                exceed the algorithm's by one message: the worker thread lets go of a
                collective's tensors a moment after the call returns, and Python keeps a
                tensor that C++ still holds. The smallest of a few calls is the algorithm's.

Traffic comes from minitron.runtime.comm's counters (comm.counting()).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class saved_bytes:
    """``with saved_bytes() as m: out = f(x)`` -> m.bytes: the storages saved for backward
    inside the block, each counted once (parameters and inputs included if they are saved,
    except the storages of the tensors in `exclude`, e.g. ``exclude=model.parameters()``)."""

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def __enter__(self):
        self.storages: dict[int, int] = {}

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._excluded:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


class PeakBytes(TorchDispatchMode):
    """``with PeakBytes() as m: ...`` -> m.peak: the largest sum of live bytes of the tensors
    created inside (tensors from before the block are not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[list, int]] = {}   # storage pointer -> (weak refs, bytes)
        self.peak = 0

    def _alive(self) -> int:
        total = 0
        for ptr in list(self.live):
            refs, nbytes = self.live[ptr]
            if any(r() is not None for r in refs):
                total += nbytes
            else:
                del self.live[ptr]
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr, entry = storage.data_ptr(), self.live.get(storage.data_ptr())
                if entry is None or not any(r() is not None for r in entry[0]):
                    entry = self.live[ptr] = ([], storage.nbytes())   # new (or reused) memory
                entry[0].append(weakref.ref(t))
        self.peak = max(self.peak, self._alive())
        return out


__all__ = ["saved_bytes", "PeakBytes"]
