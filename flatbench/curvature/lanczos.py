"""The top eigenvalues of a symmetric operator (the Hessian: `HessianOperator.top_eigenvalues`; the scaled
Hessian of Rangamani et al.) by Lanczos with full reorthogonalization, and the Lanczos tridiagonal from a
given start vector (the spectral density's quadrature, `curvature.density`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor



def lanczos_operator(matvec: Callable[[Tensor], Tensor], size: int, *, device: torch.device | str = "cpu",
                     k: int = 1, iters: int = 100, generator: torch.Generator, tol: float = 1e-6
                     ) -> dict[str, Any]:
    """The k largest (algebraic) eigenvalues of a symmetric operator (`matvec`: a float64 vector of `size`
    entries to its image) by Lanczos with full reorthogonalization.

    Stops when every wanted Ritz pair has residual ‖My − θy‖ = β_m |s_m| ≤ tol·max_i |θ_i| (an eigenvalue
    lies within the residual of θ, and θ is within residual²/gap of it; the scale is the largest wanted
    Ritz value, so for k = 1 the test is relative to λ_max itself), when the Krylov space is invariant
    (the Ritz values are then exact), or after `iters` steps (at most `size`); the result says whether it
    converged. The Lanczos vectors are kept in float64 (memory iters × size × 8 bytes) so that
    reorthogonalization is exact to double precision. Deterministic given the generator's state (one
    Gaussian start vector). Lanczos needs far fewer products than power iteration when the top eigenvalues
    are close (its convergence depends on the gap relative to the spectrum's width, power iteration's on
    the ratio λ₂/λ₁).
    """
    steps = max(1, min(int(iters), size))
    k = max(1, min(int(k), size))
    q = torch.randn(size, generator=generator, device=generator.device, dtype=torch.float64).to(device)
    # The Lanczos vectors, as rows of a buffer grown by doubling (no per-step copy of the whole basis).
    basis = torch.empty(min(steps + 1, 16), size, dtype=torch.float64, device=device)
    basis[0] = q / q.norm()
    alphas: list[float] = []
    betas: list[float] = []
    theta = torch.zeros(0, dtype=torch.float64)
    resid = torch.zeros(0, dtype=torch.float64)
    converged = False

    def store(row: int, vector: Tensor) -> None:
        nonlocal basis
        if row >= basis.shape[0]:
            grown = torch.empty(min(steps + 1, 2 * basis.shape[0]), size, dtype=torch.float64, device=device)
            grown[:basis.shape[0]] = basis
            basis = grown
        basis[row] = vector

    for j in range(steps):
        w = matvec(basis[j]).to(torch.float64)
        alpha = float(basis[j] @ w)
        alphas.append(alpha)
        q_mat = basis[:j + 1]
        for _ in range(2):  # "twice is enough" (Parlett): full reorthogonalization against every vector
            w = w - q_mat.t() @ (q_mat @ w)
        beta = float(w.norm())
        tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if j:
            off = torch.tensor(betas, dtype=torch.float64)
            tri += torch.diag(off, 1) + torch.diag(off, -1)
        evals, evecs = torch.linalg.eigh(tri)
        order = torch.argsort(evals, descending=True)[:k]
        theta = evals[order]
        resid = beta * evecs[-1, order].abs()
        scale = max(float(theta.abs().max()), 1e-30)
        invariant = beta <= 1e-12 * max(scale, abs(alpha))
        converged = j + 1 >= k and (invariant or bool((resid <= tol * scale).all()))
        if converged:
            break
        if invariant:
            # Exhausted the Krylov space before k Ritz values exist: restart with a fresh orthogonal vector.
            w = torch.randn(size, generator=generator, device=generator.device, dtype=torch.float64)
            w = w.to(device)
            for _ in range(2):
                w = w - q_mat.t() @ (q_mat @ w)
            betas.append(0.0)
            store(j + 1, w / w.norm())
            continue
        betas.append(beta)
        store(j + 1, w / beta)
    return {"eigenvalues": [float(t) for t in theta], "residuals": [float(r) for r in resid],
            "iterations": len(alphas), "converged": converged}


def lanczos_tridiagonal(matvec: Callable[[Tensor], Tensor], start: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """(α (m,), β (m−1,)): the Lanczos tridiagonal of a symmetric operator from the unit vector `start`,
    with full reorthogonalization (float64), for stochastic Lanczos quadrature. It stops early, with a
    smaller matrix, when the Krylov space is invariant: the quadrature is then exact, not restarted (a
    restart would change the start vector the quadrature weights refer to)."""
    size = start.numel()
    steps = max(1, min(int(steps), size))
    basis = torch.empty(steps, size, dtype=torch.float64, device=start.device)
    basis[0] = start.to(torch.float64)
    alphas: list[float] = []
    betas: list[float] = []
    for j in range(steps):
        w = matvec(basis[j]).to(torch.float64)
        alpha = float(basis[j] @ w)
        alphas.append(alpha)
        q_mat = basis[:j + 1]
        for _ in range(2):  # "twice is enough" (Parlett)
            w = w - q_mat.t() @ (q_mat @ w)
        beta = float(w.norm())
        scale = max(max(abs(a) for a in alphas), max(betas, default=0.0), 1e-300)
        if j + 1 == steps or beta <= 1e-10 * scale:
            break
        betas.append(beta)
        basis[j + 1] = w / beta
    return torch.tensor(alphas, dtype=torch.float64), torch.tensor(betas, dtype=torch.float64)
