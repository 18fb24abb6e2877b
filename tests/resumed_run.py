"""A training run cut by a checkpoint, for the resume tests (test_fp8*.py): the same seeded
batches every time, a save after step `save_at`, or, without `save_at`, a resume from `path`."""
import torch

from minitron.train import checkpoint


def batch(step: int):
    gen = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, 64, (4, 9), generator=gen)
    return data[:, :-1], data[:, 1:]


def train(run, total: int, path=None, save_at=None) -> list[float]:
    """The losses of steps up to `total` (from the checkpoint's step on when resuming)."""
    start = checkpoint.load(path, run.model, run.engine, run.optimizer)["step"] \
        if path is not None and save_at is None else 0
    losses = []
    for s in range(start, total):
        losses.append(run.step(*batch(s), s))
        if save_at == s + 1:
            checkpoint.save(path, run.model, run.engine, run.optimizer, step=s + 1)
    return losses
