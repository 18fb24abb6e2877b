"""The GPT on one device (reference.py) and split across ranks (parallel.py, its blocks in
blocks.py; convert.py moves weights between the two)."""
from ..config import ModelConfig
from .convert import gather_state_dict, shard_state_dict
from .parallel import ParallelGPT
from .reference import GPT

__all__ = ["ModelConfig", "GPT", "ParallelGPT", "shard_state_dict", "gather_state_dict"]
