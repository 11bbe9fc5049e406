"""Tr H to a requested relative standard error: Hutch++ with adaptive stopping.

Hutchinson's estimator zᵀHz has a variance of 2‖H‖_F² minus the diagonal's share, which a few large
eigenvalues dominate; on a transformer it left an 18% standard error after 100 HVPs (issue 29). Hutch++
(Meyer, Musco, Musco & Woodruff 2021) removes them first: with Q an orthonormal basis of H S for m random
sign vectors S (the top of the spectrum, by one step of subspace iteration), P = QQᵀ and P⊥ = I − P,

    Tr H = Tr(QᵀHQ) + Tr(P⊥ H P⊥),

the first term exact (m more HVPs for HQ), the second estimated by Hutchinson on the deflated matrix,
whose variance is what is left after the top of the spectrum is gone. Here the second term's probes are
drawn one at a time until its standard error (the sample standard deviation over √probes) is at most
`rtol`·|estimate|, or until the budget of HVPs is spent (`converged: False`). The standard error is
therefore that of an average of i.i.d. samples, and nothing else: the deflated part is exact.

The per-parameter-tensor traces come with it at no extra HVP: the diagonal of the deterministic part,
P H P + P H P⊥ + P⊥ H P, is rowsum(Q ⊙ (2 HQ − Q T)) with T = QᵀHQ, and z ⊙ P⊥HP⊥z is an unbiased
sample of the deflated diagonal (E[z zᵀ] = I), so the per-tensor estimates add up to the total exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flatbench.curvature.common import Welford

HUTCHPP_DEFAULTS: dict[str, Any] = {"rtol": 0.01, "max_hvps": 2000, "sketch": 20, "min_probes": 10}
"""Requested relative standard error, HVP budget (sketch included), sketch size m, probes before a stop."""


def _signs(rows: int, cols: int, generator: torch.Generator, device: torch.device) -> Tensor:
    bits = torch.randint(0, 2, (rows, cols), generator=generator, device=generator.device)
    return (bits * 2 - 1).to(device=device, dtype=torch.float64)


def _apply(matvec: Callable[[Tensor], Tensor], vectors: Tensor) -> Tensor:
    """H applied to each column of `vectors` (size × m)."""
    return torch.stack([matvec(vectors[:, j]) for j in range(vectors.shape[1])], dim=1)


def _sketch(matvec: Callable[[Tensor], Tensor], size: int, m: int, generator: torch.Generator,
            device: torch.device) -> tuple[Tensor, Tensor]:
    """(Q, HQ): Q an orthonormal basis of H S for m sign vectors S (2m HVPs)."""
    y = _apply(matvec, _signs(size, m, generator, device))
    q, _ = torch.linalg.qr(y)
    return q, _apply(matvec, q)


def hutchpp_trace(matvec: Callable[[Tensor], Tensor], size: int, *, generator: torch.Generator,
                  blocks: list[int] | None = None, rtol: float = 0.01, max_hvps: int = 2000, sketch: int = 20,
                  min_probes: int = 10, device: torch.device | None = None) -> dict[str, Any]:
    """Tr H of the symmetric operator `matvec` (flat float64 vectors of length `size`) by adaptive Hutch++.

    `blocks`: lengths of consecutive parameter blocks (e.g. per tensor; default one block). Returns
    `trace`, `stderr`, `rel_stderr`, `block_traces`, `block_stderrs`, `hvps` (the cost), `probes`,
    `sketch` (m used), `converged` (stderr ≤ rtol·|trace| reached within `max_hvps`). Deterministic given
    the generator's state. With m ≥ size the deflated part is empty and the trace exact (stderr 0)."""
    device = device or torch.device("cpu")
    blocks = list(blocks or [size])
    if sum(blocks) != size:
        raise ValueError(f"blocks add up to {sum(blocks)}, the operator has size {size}")
    m = max(0, min(int(sketch), size, (int(max_hvps) - 1) // 2))
    q, hq = _sketch(matvec, size, m, generator, device) if m else (torch.zeros(size, 0, dtype=torch.float64,
                                                                              device=device),) * 2
    det = (q * (2 * hq - q @ (q.t() @ hq))).sum(1)
    bounds = torch.tensor([0] + blocks, device=device).cumsum(0).tolist()
    det_blocks = [float(det[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    total, per_block = Welford(), [Welford() for _ in blocks]
    hvps = 2 * m
    exhausted = q.shape[1] >= size
    while not exhausted and hvps < max_hvps:
        z = _signs(size, 1, generator, device)[:, 0]
        w = z - q @ (q.t() @ z)
        hw = matvec(w)
        hvps += 1
        sample = z * (hw - q @ (q.t() @ hw))
        total.add(float(sample.sum()))
        for acc, a, b in zip(per_block, bounds[:-1], bounds[1:]):
            acc.add(float(sample[a:b].sum()))
        estimate = sum(det_blocks) + total.mean
        if total.count >= max(2, min_probes) and total.stderr() <= rtol * abs(estimate):
            break
    trace = sum(det_blocks) + (total.mean if total.count else 0.0)
    stderr = 0.0 if exhausted else (float(total.stderr()) if total.count >= 2 else float("nan"))
    return {"trace": float(trace), "stderr": stderr,
            "rel_stderr": stderr / abs(trace) if trace else float("inf"),
            "block_traces": [d + (acc.mean if acc.count else 0.0) for d, acc in zip(det_blocks, per_block)],
            "block_stderrs": [0.0 if exhausted else float(acc.stderr()) for acc in per_block],
            "hvps": hvps, "probes": total.count, "sketch": int(q.shape[1]),
            "converged": bool(exhausted or stderr <= rtol * abs(trace))}
