"""The loss Hessian of a model on a data set as one operator object.

Every curvature quantity flatbench computes is a question about one matrix, H = ∇²_θ L(θ) of the mean
loss of a model over its measurement set. Before this object, that matrix was described again at every
call by six arguments (model, inputs, targets, loss, chunk size, HVP mode) threaded through the measures,
Hutchinson and Lanczos. `HessianOperator` holds them once, like curvlinops' `HessianLinearOperator`
(a linear operator built from the model, the loss and the data), and answers the questions:

    H = HessianOperator(model, inputs, targets, loss, chunk_size=2000)
    H @ v                      # Hessian-vector product; v a dict keyed like named_parameters, or flat
    H.trace(generator=g)       # Hutchinson's estimate, with its standard error
    H.hutchpp_trace(generator=g, rtol=0.01)   # Hutch++ until the relative standard error is rtol
    H.diagonal()               # exact for piecewise-linear nets and smooth chains, else Hutchinson
    H.top_eigenvalues(k=1, generator=g)   # Lanczos with full reorthogonalization
    H.block_top_eigenvalues(groups, generator=g)   # the same per diagonal block (a layer's parameters)
    H.spectral_density(generator=g)       # stochastic Lanczos quadrature: density on a grid, moments

The operator reads the model's parameters when it is applied (it holds no copy), so it stays valid while
the weights are those it was built on; a measure that perturbs or rescales weights builds its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from flatbench.curvature.applicability import exact_applicable
from flatbench.curvature.common import Welford, detached_params, flatten, rademacher, unflatten
from flatbench.curvature.density import slq, spectral_density
from flatbench.curvature.diagonal import DiagonalResult, NotExact, exact_diagonal
from flatbench.curvature.hvp import dense_diagonal, hvp
from flatbench.curvature.lanczos import lanczos_operator
from flatbench.curvature.smooth import smooth_chain, smooth_diagonal
from flatbench.curvature.trace import HUTCHPP_DEFAULTS, hutchpp_trace
from flatbench.seeding import make_generator

DEFAULT_HUTCHINSON_PROBES = 100
"""Probes of the Hutchinson diagonal where the exact one does not apply (and of `trace` when neither
probes nor rtol are given)."""
DIAGONAL_METHODS = ("auto", "exact", "dense", "hutchinson")
DENSE_MAX_PARAMS = 3000
"""Up to this many parameters the shared Hessian diagonal (`measures.shared.hessian_diagonal`) and
`hessian_trace` (its `exact_max_params` default) are exact for any architecture, by the dense diagonal:
one second-order backward pass per parameter, e.g. 14 s for a 5,482-parameter attention network on 8
examples, 1.2 s for a 218-parameter LSTM on 16 (2 CPU threads, float64)."""


class HessianOperator:
    """H of the mean `loss` of `model` over (inputs, targets); see the module doc.

    `chunk_size` bounds the examples of one forward pass (products are weighted by each chunk's share of
    the examples, so the result does not depend on it); `mode` is the HVP mode (`curvature.HVP_MODES`;
    None: the model's, see `use_hvp_mode`)."""

    def __init__(self, model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, *,
                 chunk_size: int = 2000, mode: str | None = None):
        self.model, self.inputs, self.targets, self.loss = model, inputs, targets, loss
        self.chunk_size, self.mode = int(chunk_size), mode

    # ------------------------------------------------------------ the matrix

    @property
    def params(self) -> dict[str, Tensor]:
        """The parameters H is taken over (detached, keyed like `named_parameters`)."""
        return detached_params(self.model)

    @property
    def size(self) -> int:
        """The number of parameters: H is size × size."""
        return sum(p.numel() for p in self.model.parameters())

    def __matmul__(self, vec: dict[str, Tensor] | Tensor) -> dict[str, Tensor] | Tensor:
        """H v: same structure as `vec` (dict or flat vector), in the parameters' dtype."""
        return hvp(self.model, self.inputs, self.targets, self.loss, vec, chunk_size=self.chunk_size,
                   mode=self.mode)

    def flat_matvec(self) -> Callable[[Tensor], Tensor]:
        """v ↦ H v on flat float64 vectors (what `lanczos_operator` and other Krylov methods take)."""
        params = self.params
        names = list(params)
        return lambda v: flatten(self @ unflatten(v, params), names, torch.float64)

    # ------------------------------------------------------------ what is asked of it

    def trace(self, *, generator: torch.Generator, probes: int | None = None, rtol: float | None = None,
              max_probes: int = 1000, min_probes: int = 10) -> dict[str, Any]:
        """Tr H ≈ mean of zᵀHz over Rademacher probes z, with its standard error.

        With `probes` a fixed count is drawn; otherwise, with `rtol`, probes are drawn until the standard
        error is at most rtol·|mean| (at least `min_probes`, at most `max_probes`); with neither,
        `DEFAULT_HUTCHINSON_PROBES`. Deterministic given the generator's state."""
        params = self.params
        if probes is None and rtol is None:
            probes = DEFAULT_HUTCHINSON_PROBES
        limit = probes if probes is not None else max_probes
        acc = Welford()
        while acc.count < limit:
            z = rademacher(params, generator)
            hz = self @ z
            acc.add(float(sum((z[k].double() * hz[k].double()).sum() for k in params)))
            if probes is None and acc.count >= max(2, min_probes) and acc.stderr() <= rtol * abs(acc.mean):
                break
        return {"mean": float(acc.mean), "stderr": float(acc.stderr()), "probes": acc.count}

    def hutchpp_trace(self, *, generator: torch.Generator, max_memory_mb: int = 1024,
                      **settings: Any) -> dict[str, Any]:
        """Tr H to a requested relative standard error by adaptive Hutch++ (`curvature.trace`), with the
        trace of each parameter tensor (`block_traces`, keyed like `named_parameters` in `per_param`).
        `settings`: rtol, max_hvps, sketch, max_sketch, min_probes (`HUTCHPP_DEFAULTS`). The sketch grows
        no further than `max_sketch` nor than what fits in `max_memory_mb` (Q and the kept probe images,
        float64: 16 bytes per parameter and vector), and never below `sketch`; `max_sketch` in the result
        is the limit that applied."""
        params = self.params
        device = next(iter(params.values())).device
        settings = {**HUTCHPP_DEFAULTS, **settings}
        fits = int(max_memory_mb) * 2 ** 20 // (16 * max(1, self.size))
        settings["max_sketch"] = min(int(settings["max_sketch"]), max(int(settings["sketch"]), fits))
        out = hutchpp_trace(self.flat_matvec(), self.size, generator=generator, device=device,
                            blocks=[p.numel() for p in params.values()], **settings)
        out["max_sketch"] = settings["max_sketch"]
        out["per_param"] = dict(zip(params, out["block_traces"]))
        out["stderr_per_param"] = dict(zip(params, out["block_stderrs"]))
        return out

    def exact_diagonal_applies(self) -> tuple[bool, str]:
        """Whether a structural exact diagonal (piecewise linear, or a smooth Sequential chain) applies to
        the model, and why (not), without computing anything beyond a traced forward on one example."""
        ok, reason = exact_applicable(self.model, self.inputs[:1])
        if ok:
            return True, reason
        chain, why = smooth_chain(self.model)
        return chain is not None, why if chain is not None else f"{reason}; {why}"

    def diagonal(self, *, method: str = "auto", max_memory_mb: int = 1024,
                 generator: torch.Generator | None = None,
                 hutchinson_probes: int = DEFAULT_HUTCHINSON_PROBES, dense_max_params: int = 0
                 ) -> DiagonalResult:
        """diag H: exact where it can be, else Hutchinson's estimate.

        Exact, in this order: where the logits are piecewise linear in every single parameter
        (`curvature.diagonal`, decided by `exact_applicable`; the GGN is the Hessian there); for a Sequential
        chain with smooth elementwise activations (`curvature.smooth`: the GGN plus the σ'' terms); for a
        model of at most `dense_max_params` parameters (default 0: never), row by row, one second-order
        backward pass per parameter (`dense_diagonal`). `method` is 'auto', 'exact' (ValueError when none applies), 'dense' or
        'hutchinson'. `loss` must provide `logit_hessian` for the first two (`flatbench.losses`). The
        generator is only used by Hutchinson; without one a fixed seed keeps results reproducible."""
        if method not in DIAGONAL_METHODS:
            raise ValueError(f"method must be auto, exact, dense or hutchinson, got {method!r}")
        if method == "dense":
            return self.dense_diagonal(reason="dense requested")
        if method == "hutchinson":
            ok, why = exact_applicable(self.model, self.inputs[:1])
            reason = "hutchinson requested" if ok else why
        else:
            found, reason = self._exact_diagonal(max_memory_mb, dense_max_params)
            if found is not None:
                return found
            if method == "exact":
                raise ValueError(f"exact Hessian diagonal not applicable: {reason}")
        if generator is None:
            generator = make_generator("hessian_diagonal", "default", device=self.inputs.device)
        return self.hutchinson_diagonal(generator=generator, probes=hutchinson_probes, reason=reason)

    def _exact_diagonal(self, max_memory_mb: int, dense_max_params: int) -> tuple[DiagonalResult | None, str]:
        """The first exact diagonal that applies (piecewise linear, smooth chain, dense), or (None, why
        none does: the piecewise-linear verdict first, then the smooth chain's)."""
        ok, reason = exact_applicable(self.model, self.inputs[:1])
        kw = {"max_memory_mb": max_memory_mb, "chunk_size": self.chunk_size}
        if ok:
            try:
                return exact_diagonal(self.model, self.inputs, self.targets, self.loss, **kw), reason
            except NotExact as exc:
                reason = str(exc)
        else:
            chain, why = smooth_chain(self.model)
            if chain is not None:
                try:
                    return smooth_diagonal(self.model, self.inputs, self.targets, self.loss, **kw), why
                except NotExact as exc:
                    why = str(exc)
            reason = f"{reason}; {why}"
        if self.size <= dense_max_params:
            return self.dense_diagonal(reason=f"{self.size} parameters ≤ {dense_max_params}"), ""
        return None, reason

    def dense_diagonal(self, *, reason: str = "") -> DiagonalResult:
        """diag H row by row (`hvp.dense_diagonal`: one second-order backward pass per parameter), exact for
        any architecture; for small models (`dense_max_params`)."""
        diag = dense_diagonal(self.model, self.inputs, self.targets, self.loss, chunk_size=self.chunk_size)
        return DiagonalResult(diag=diag, method="exact", reason=f"dense: {reason}" if reason else "dense",
                              n=int(self.inputs.shape[0]))

    def hutchinson_diagonal(self, *, generator: torch.Generator, probes: int = DEFAULT_HUTCHINSON_PROBES,
                            reason: str = "hutchinson requested") -> DiagonalResult:
        """diag H ≈ mean of z ⊙ Hz (Rademacher z: E[z_i z_j] = δ_ij, so the mean is unbiased), with
        per-element standard errors and per-tensor trace standard errors from the per-probe sums; its cost
        is `probes` HVPs over the whole set."""
        params = self.params
        elem = {k: Welford() for k in params}
        per_tensor = {k: Welford() for k in params}
        total = Welford()
        for _ in range(max(1, probes)):
            z = rademacher(params, generator)
            hz = self @ z
            sample_total = 0.0
            for k in params:
                sample = z[k].double() * hz[k].double()
                elem[k].add(sample)
                s = float(sample.sum())
                per_tensor[k].add(s)
                sample_total += s
            total.add(sample_total)
        return DiagonalResult(diag={k: w.mean for k, w in elem.items()}, method="hutchinson",
                              stderr={k: w.stderr() for k, w in elem.items()}, probes=total.count,
                              trace_stderr={k: float(w.stderr()) for k, w in per_tensor.items()},
                              total_trace_stderr=float(total.stderr()), reason=reason,
                              n=int(self.inputs.shape[0]))

    def spectral_density(self, *, generator: torch.Generator, runs: int = 5, iters: int = 50, grid: int = 200,
                         sigma: float = 0.01) -> dict[str, Any]:
        """The spectral density of H by stochastic Lanczos quadrature (`curvature.density`): `runs` × `iters`
        HVPs; the density on a grid, its moments and extreme eigenvalues, and `hvps` (the cost)."""
        device = next(iter(self.params.values())).device
        quad = slq(self.flat_matvec(), self.size, runs=runs, iters=iters, generator=generator, device=device)
        out = spectral_density(quad, grid=grid, sigma=sigma)
        out["hvps"] = sum(int(t.numel()) for t, _ in quad)
        out["quadrature"] = quad
        return out

    def top_eigenvalues(self, *, k: int = 1, iters: int = 100, generator: torch.Generator, tol: float = 1e-6
                        ) -> dict[str, Any]:
        """The k largest (algebraic) eigenvalues of H by Lanczos with full reorthogonalization
        (`lanczos_operator`; HVPs in the model's dtype): eigenvalues, residuals, iterations, converged."""
        device = next(iter(self.params.values())).device
        return lanczos_operator(self.flat_matvec(), self.size, device=device, k=k, iters=iters,
                                generator=generator, tol=tol)

    def block_top_eigenvalues(self, groups: dict[str, list[str]], *, iters: int = 100, generator: torch.Generator,
                              tol: float = 1e-6) -> dict[str, dict[str, Any]]:
        """Per group of parameters (name -> parameter names, e.g. one layer's weight and bias), the largest
        eigenvalue of H's diagonal block of that group (the Hessian of the loss in those parameters with the
        others fixed), by Lanczos on the block's products (one full HVP each): eigenvalue, residual,
        iterations, converged, size."""
        params = self.params
        device = next(iter(params.values())).device
        out: dict[str, dict[str, Any]] = {}
        for group, members in groups.items():
            sizes = [params[n].numel() for n in members]

            def matvec(v: Tensor, members: list[str] = members, sizes: list[int] = sizes) -> Tensor:
                full = {n: torch.zeros_like(p) for n, p in params.items()}
                for n, part in zip(members, torch.split(v, sizes)):
                    full[n] = part.view_as(params[n]).to(params[n].dtype)
                hv = self @ full
                return flatten({n: hv[n] for n in members}, members, torch.float64)

            res = lanczos_operator(matvec, sum(sizes), device=device, k=1, iters=iters, generator=generator, tol=tol)
            out[group] = {"eigenvalue": res["eigenvalues"][0], "residual": res["residuals"][0],
                          "iterations": res["iterations"], "converged": res["converged"], "size": sum(sizes)}
        return out


def hessian_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Any, *, max_memory_mb: int = 1024,
                     chunk_size: int = 2000, generator: torch.Generator | None = None,
                     hutchinson_probes: int = DEFAULT_HUTCHINSON_PROBES, method: str = "auto") -> DiagonalResult:
    """`HessianOperator(model, inputs, targets, loss, chunk_size=...).diagonal(...)`, for callers that ask
    only for the diagonal (the shared cache, the tests against full Hessians)."""
    return HessianOperator(model, inputs, targets, loss, chunk_size=chunk_size).diagonal(
        method=method, max_memory_mb=max_memory_mb, generator=generator, hutchinson_probes=hutchinson_probes)
