"""Result keys: the one place that builds and splits them.

A measure's results are stored under keys of the form

    name[:variant][@loss][/detail]

`name` is the registered measure, `:variant` a preset of its settings (e.g. `minimum_sharpness:published`),
`@loss` the loss it was computed with when that is not `ce` (e.g. `hessian_trace@normalized_ce`), and
`/detail` a per-layer or per-parameter detail (e.g. `hessian_trace/layers.0.weight`); a key without a
detail is a headline value, the one the statistics rank. This module imports nothing heavy, so the
analysis stage can read keys without loading the measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Key:
    measure: str
    """The registered name, with its variant if any (`minimum_sharpness:published`)."""
    loss: str
    """`ce` unless the key says otherwise."""
    detail: str
    """"" for a headline value."""


def loss_tag(loss: str) -> str:
    """How a loss appears in a key: its name, or for a function of one's own (`file.py:function`,
    `pkg.module:function`) the function's name."""
    return loss.rsplit(":", 1)[-1] if ":" in loss else loss


def loss_tag_clash(losses: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """Two different losses that would share entry keys (`loss_tag`: two functions of one's own of one name
    in different files or modules), or None."""
    seen: dict[str, str] = {}
    for loss in losses:
        tag = loss_tag(loss)
        if tag in seen and seen[tag] != loss:
            return seen[tag], loss
        seen.setdefault(tag, loss)
    return None


def entry_key(name: str, loss: str | None) -> str:
    """measures.json entry key of a measure (or variant) computed with a loss: `@loss` unless it is `ce`."""
    return name if loss in (None, "ce") else f"{name}@{loss_tag(loss)}"


def entry_keys(name: str, spec: Any, losses: list[str] | tuple[str, ...]) -> list[tuple[str | None, str]]:
    """(loss, entry key) for every computation of one measure: once per configured loss for a measure that
    `uses_loss`, else once (loss None)."""
    return [(loss, entry_key(name, loss)) for loss in (losses if spec.uses_loss else (None,))]


def parse_key(key: str) -> Key:
    """Split `name[:variant][@loss][/detail]`."""
    head, _, detail = key.partition("/")
    measure, _, loss = head.partition("@")
    return Key(measure, loss or "ce", detail)


def value_key(spec_name: str, base: str, loss: str | None, key: str) -> str:
    """The stored key of a value a measure function returned under `key` (its own name, or `name/detail`):
    renamed to the variant's name when `spec_name` is a variant of `base`, and given `@loss`."""
    name, _, detail = key.partition("/")
    if name == base:
        name = spec_name
    return entry_key(name, loss) + (f"/{detail}" if detail else "")
