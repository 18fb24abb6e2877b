"""torch.distributed.checkpoint planners that take placements instead of DTensors.

DCP describes a saved tensor by its global shape and the chunks (offsets, sizes) the ranks
wrote; its default planners learn those from DTensor/ShardedTensor objects. minitron's ranks
hold plain tensors whose place in the reference tensor comes from model/convert.py's rules
(checkpoint_pieces.placements), so these planners take {fqn: (piece, global shape, offsets)} and hand
DCP exactly that. Everything else (deduplicating replicated pieces, checking that the pieces
tile each tensor, computing which saved chunks overlap a wanted piece) is DCP's own.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .checkpoint_manifest import CheckpointError


class PlacedSavePlanner(DefaultSavePlanner):
    """Writes each piece at its placement (DCP's default planner assumes a whole tensor)."""

    def __init__(self, placed: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.placed = placed

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape),
                               properties=TensorProperties.create_from_tensor(t),
                               size=torch.Size(shape)))
                 for fqn, (t, shape, off) in self.placed.items()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.placed[write_item.index.fqn][0].detach().contiguous()


class PlacedLoadPlanner(DefaultLoadPlanner):
    """Reads, for each wanted placement, the overlapping parts of the saved pieces."""

    def __init__(self, wanted: dict, path: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.wanted, self.path = wanted, path

    def create_local_plan(self) -> LoadPlan:
        saved, requests = self.metadata.state_dict_metadata, []
        for fqn, (t, shape, off) in self.wanted.items():
            if fqn not in saved:
                raise CheckpointError(f"{self.path}: holds no tensor {fqn!r} (saved from another "
                                      "model, or without optimizer state)")
            if tuple(saved[fqn].size) != tuple(shape):
                raise CheckpointError(f"{self.path}: {fqn} has shape {tuple(saved[fqn].size)}, this "
                                      f"model needs {tuple(shape)}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape)
            requests += create_read_items_for_chunk_list(fqn, saved[fqn], [chunk])
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.wanted[index.fqn][0]
