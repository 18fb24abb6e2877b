"""Dropout masks on a tensor-parallel rank, drawn one of two ways (ModelConfig.dropout_rng).

"exact" (the default, and what the verifier checks): every rank draws the *full* mask and
keeps its own slice (its heads, or its part of the sequence under sequence parallelism), and
every mask is *keyed* rather than streamed: row r of the batch in the k-th dropout call of
layer i comes from a generator seeded by (step seed, i, k, r), the embedding's being layer -1.
The single-device reference draws the same keyed masks, so the parallel run's masks are the
reference's, element for element, whatever order the work is done in: a pipeline stage that
runs only layers 4-7, a micro-batch that holds rows 6-7, a data-parallel rank that holds half
of the batch each say where they are (`at_layer`, `rows_from`) and draw exactly the
reference's rows (counter-based generators such as Philox, which FlashAttention uses, give
the same property on GPUs). The cost is RNG work and memory, never communication: the
attention-probability mask is [b, heads, s, s] on every rank, tp times what the rank keeps
(at b=1, 64 heads, s=8192 the float32 draw is 17 GB per layer, whatever tp is).

"per_rank" (Megatron's way, megatron/core/tensor_parallel/random.py,
model_parallel_cuda_manual_seed): two streams per rank,
  replicated       seeded `seed` on every rank: dropout on activations every TP rank holds
                   whole (embedding and residual dropout without SP), so the masks are
                   identical across the group, as the replicated activations require;
  tensor_parallel  seeded seed + 2718 + tp_rank: dropout on split activations (attention
                   probabilities of this rank's heads; under SP also the embedding and
                   residual dropout, whose activations are this rank's tokens), so each
                   rank draws only its own shape and the masks differ across the group.
Nothing larger than the local tensor is ever drawn, but the masks are no single-device run's:
with dropout > 0 the reference can no longer be matched (with dropout = 0, or in eval mode,
nothing is drawn and the two modes are the same computation). Megatron also adds
100 * pipeline rank to the seed first and keeps a third stream for experts; ParallelGPT has
no experts yet, and its pipeline stages are not seeded apart (per_rank is not verified).

A call site says which region it is in by passing `index`: x is this rank's slice `index`
of a split tensor of `full_shape`. Without it, x is replicated (or there is no TP at all).

Masks are drawn on the device of the tensor they mask, from one generator per stream and
device, so a model moved with `.to(device)` keeps working. CPU and CUDA generators produce
different streams: compare a parallel run with a reference on the same kind of device.
"""
from __future__ import annotations

import torch

MODES = ("exact", "per_rank")
REPLICATED, TENSOR_PARALLEL = "replicated", "tensor_parallel"
TP_SEED_OFFSET = 2718   # Megatron's: "2718 is just for fun and any POSITIVE value will work"


_MASK64 = (1 << 64) - 1


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): nearby keys give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = ((h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


class DropoutRNG:
    """Exact mode: keyed masks, the same on every TP rank and in the reference model.

    `elements_drawn` and `largest_draw` count the random numbers generated (the transient
    float mask is 4 bytes each), so the memory of either mode can be measured.
    """

    def __init__(self, seed: int = 1234, device: torch.device | str = "cpu"):
        self.seed = seed
        self.device = torch.device(device)   # where keep_mask draws when not told otherwise
        self._current_seed = seed
        self._generators: dict[tuple[str, torch.device], torch.Generator] = {}
        self._layer, self._call, self._first_row = -1, 0, 0
        self.elements_drawn = 0
        self.largest_draw = 0

    # ---- where the next mask sits: its key --------------------------------------------------
    def reset(self, seed: int | None = None) -> None:
        """Start a step (call it at the start of every step on every rank): its seed, the
        embedding's site, batch row 0."""
        self._current_seed = self.seed if seed is None else seed
        self._layer, self._call, self._first_row = -1, 0, 0
        for (stream, _), gen in self._generators.items():
            gen.manual_seed(self.stream_seed(stream))

    def at_layer(self, layer: int) -> None:
        """The next masks belong to block `layer` (its global index; -1 is the embedding)."""
        self._layer, self._call = layer, 0

    def rows_from(self, first_row: int) -> None:
        """The next tensors' row 0 is row `first_row` of the step's global batch."""
        self._first_row = first_row

    def row_ids(self, n: int) -> list[int]:
        """The global batch rows of the next tensors' first n rows (rows_from)."""
        return list(range(self._first_row, self._first_row + n))

    # ---- what differs between the modes -------------------------------------------------
    def stream_of(self, region: str) -> str:
        """The generator stream a region draws from: exact mode keys every mask instead."""
        return "keyed"

    def stream_seed(self, stream: str) -> int:
        return self._current_seed

    def local_mask(self, x: torch.Tensor, p: float, index, full_shape) -> torch.Tensor:
        """This rank's keep-mask for x: the full mask's slice `index`."""
        mask = self.keep_mask(full_shape or x.shape, p, device=x.device)
        return mask if index is None else mask[index]

    def _uniform(self, shape, device: torch.device, region: str) -> torch.Tensor:
        """Exact mode: row r from a generator seeded by (step seed, layer, call, global row)."""
        gen = self._generator(device, "keyed")
        rows = []
        for r in range(shape[0]):
            gen.manual_seed(_mix(self._current_seed, self._layer, self._call, self._first_row + r))
            rows.append(torch.rand(shape[1:], generator=gen, device=device))
        self._call += 1
        return torch.stack(rows) if rows else torch.empty(shape, device=device)

    # ---- shared machinery -----------------------------------------------------------------
    def _generator(self, device: torch.device, stream: str) -> torch.Generator:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (stream, device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.stream_seed(stream))
            self._generators[key] = gen
        return self._generators[key]

    def keep_mask(self, shape, p: float, device: torch.device | str | None = None,
                  region: str = REPLICATED) -> torch.Tensor:
        """A boolean keep-mask of `shape` ([batch rows, ...]), the next one of its site."""
        if region not in (REPLICATED, TENSOR_PARALLEL):
            raise ValueError(f"region must be {REPLICATED!r} or {TENSOR_PARALLEL!r}, got {region!r}")
        device = torch.device(device) if device is not None else self.device
        uniform = self._uniform(tuple(shape), device, region)
        self.elements_drawn += uniform.numel()
        self.largest_draw = max(self.largest_draw, uniform.numel())
        return uniform >= p

    def dropout(self, x: torch.Tensor, p: float, training: bool, index=None,
                full_shape=None) -> torch.Tensor:
        """Inverted dropout. `index` picks this rank's slice of a split tensor of `full_shape`."""
        if not training or p == 0.0:
            return x
        mask = self.local_mask(x, p, index, full_shape)
        return x * mask.to(x.dtype) / (1.0 - p)


class PerRankDropoutRNG(DropoutRNG):
    """Megatron's seeding: a replicated stream (seed) and a tensor-parallel one (seed+2718+tp_rank)."""

    def __init__(self, seed: int = 1234, tp_rank: int = 0, device: torch.device | str = "cpu"):
        if type(tp_rank) is not int or tp_rank < 0:
            raise ValueError(f"tp_rank must be a non-negative integer, got {tp_rank!r}")
        self.tp_rank = tp_rank
        super().__init__(seed, device)

    def stream_of(self, region: str) -> str:
        return region

    def stream_seed(self, stream: str) -> int:
        if stream == TENSOR_PARALLEL:
            return self._current_seed + TP_SEED_OFFSET + self.tp_rank
        return self._current_seed

    def local_mask(self, x: torch.Tensor, p: float, index, full_shape) -> torch.Tensor:
        """Only x's own shape is drawn, from the stream of the region x lives in."""
        region = REPLICATED if index is None else TENSOR_PARALLEL
        return self.keep_mask(x.shape, p, device=x.device, region=region)

    def _uniform(self, shape, device: torch.device, region: str) -> torch.Tensor:
        """The next numbers of the region's stream, in call order (Megatron's generators)."""
        return torch.rand(shape, generator=self._generator(device, self.stream_of(region)),
                          device=device)


def make_dropout_rng(mode: str, seed: int, tp_rank: int = 0,
                     device: torch.device | str = "cpu") -> DropoutRNG:
    """The DropoutRNG of ModelConfig.dropout_rng `mode` for TP rank `tp_rank`."""
    if mode == "exact":
        return DropoutRNG(seed, device=device)
    if mode == "per_rank":
        return PerRankDropoutRNG(seed, tp_rank=tp_rank, device=device)
    raise ValueError(f"dropout_rng={mode!r}: choose one of {MODES}")
