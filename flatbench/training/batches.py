"""How a run goes through its training set: each epoch's seeded mini-batches and their augmentation.

Both draw their random numbers from generators seeded by the run's config and epoch
(`seeding.batch_generator`, `seeding.augment_generator`), so a resumed run replays the same batches, and a
run trained in a vectorized group sees exactly the batches it sees alone.
"""

from __future__ import annotations

import torch
from torch import Tensor


def epoch_batches(n: int, batch_size: int, generator: torch.Generator) -> list[Tensor]:
    """One epoch's mini-batches: index slices of a seeded permutation of range(n), last partial batch kept.

    The permutation is drawn on the generator's device, so a CUDA generator gives CUDA indices.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    perm = torch.randperm(n, generator=generator, device=generator.device)
    return list(perm.split(batch_size))


def augment_batch(x: Tensor, generator: torch.Generator, flip: bool, pad: int) -> Tensor:
    """Random crop after reflection padding (as in Zagoruyko & Komodakis), plus optional horizontal flip.

    Vectorized over the batch: one padded copy, then a single gather with per-sample crop offsets (and
    reversed column indices for the flipped samples). Reflection rather than zero padding keeps the
    border statistics of normalized inputs; for MNIST's black borders the two are nearly the same.
    Random numbers come from `generator` (on its own device), so the result is determined by its state.
    """
    if pad < 0:
        raise ValueError(f"pad must be non-negative, got {pad}")
    if pad == 0 and not flip:
        return x
    B, _, H, W = x.shape
    if pad >= min(H, W):
        raise ValueError(f"pad {pad} is too large for {H}×{W} inputs (reflection needs pad < size)")
    gdev = generator.device
    oy = torch.randint(0, 2 * pad + 1, (B,), generator=generator, device=gdev).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (B,), generator=generator, device=gdev).to(x.device)
    rows = oy[:, None] + torch.arange(H, device=x.device)
    cols = torch.arange(W, device=x.device).expand(B, W)
    if flip:
        flipped = (torch.rand(B, generator=generator, device=gdev) < 0.5).to(x.device)
        cols = torch.where(flipped[:, None], cols.flip(-1), cols)
    cols = ox[:, None] + cols
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), mode="reflect") if pad else x
    batch = torch.arange(B, device=x.device)[:, None, None, None]
    channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]
