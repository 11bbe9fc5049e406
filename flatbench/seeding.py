"""Derived seeds: every random stream of a run gets its own seed, computed from stable names.

Seeds are derived by hashing (never from Python's salted `hash`) so that the same config gives the same
labels, initial weights, batch order and measure probes on every machine and in every process.
"""

from __future__ import annotations

import hashlib

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
