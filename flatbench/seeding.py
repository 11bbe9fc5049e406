"""Derived seeds: every random stream of a run gets its own seed, computed from stable names.

Seeds are derived by hashing (never from Python's salted `hash`) so that the same config gives the same
labels, initial weights, batch order and measure probes on every machine and in every process.

Each stream depends only on the config fields that shape it, never on the run id (which depends on the
whole config):

| stream | seeded by |
| --- | --- |
| initial weights | seed, the model's fields |
| random labels, data subsets | `data.seed` (default: seed), the data fields that define them (`flatbench.data`) |
| batch order, augmentation | seed, dataset, n_train, batch size, epoch |
| dropout | seed, epoch |
| measure probes | seed, measure name (and a tag per use) |

So runs that differ only in their random-label ratio start from the same weights and see the same batch
order: the labels are the only difference between them. Growing a study (another axis, another ratio)
changes no existing run's streams.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any sequence of printable parts, stable across processes and platforms."""
    text = "\x1f".join(repr(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def make_generator(*parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `derive_seed(*parts)`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(*parts))
    return gen


def _model_fields(cfg: Any) -> str:
    return json.dumps({k: v for k, v in cfg.identity().items() if k.startswith("model.")}, sort_keys=True)


def init_seed(cfg: Any) -> int:
    """Seed of a run's initial weights: its seed and model fields (a `RunConfig`)."""
    return derive_seed("init", cfg.seed, _model_fields(cfg))


def batch_generator(cfg: Any, epoch: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The epoch's batch order: seed, dataset, training-set size, batch size, epoch."""
    return make_generator("batches", cfg.seed, cfg.data.dataset, cfg.data.n_train, cfg.train.batch_size, epoch,
                          device=device)


def augment_generator(cfg: Any, epoch: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The epoch's crops and flips: seed, dataset, training-set size, batch size, epoch."""
    return make_generator("augment", cfg.seed, cfg.data.dataset, cfg.data.n_train, cfg.train.batch_size, epoch,
                          device=device)


def dropout_seed(cfg: Any, epoch: int) -> int:
    """The global torch seed set before an epoch (dropout masks): seed and epoch."""
    return derive_seed("dropout", cfg.seed, epoch)


def probe_generator(seed: int, measure: str, *tags: object, device: str | torch.device = "cpu"
                    ) -> torch.Generator:
    """A measure's random probes (perturbations, start vectors): the run's seed and the measure's name."""
    return make_generator("measure", seed, measure, *tags, device=device)
