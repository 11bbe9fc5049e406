"""The curvature engine: exact Hessian diagonal, Hessian-vector products, Hutchinson, Lanczos.

Every Hessian-based measure rests on these primitives, so they are computed once per (model, loss) and
shared through `MeasureContext.cached` (`diagonal_for`).

**Exact diagonal.** For a network whose logits are piecewise linear in every *single* parameter (Linear,
Conv2d, ReLU, max/avg pooling, flatten, residual additions, BatchNorm with running statistics),
`∂²f/∂θ_k² = 0` almost everywhere, so for a loss ℓ on the logits

    H_kk = (1/n) Σ_n J_n[:,k]ᵀ ∇²_f ℓ_n J_n[:,k] = (1/n) Σ_n Σ_c λ_nc (u_ncᵀ J_n[:,k])²

with the per-example eigendecomposition ∇²_f ℓ_n = Σ_c λ_nc u_nc u_ncᵀ (signs kept: the logit Hessian of
`normalized_ce` is indefinite). Both losses are unchanged by adding a constant to all logits, so the
all-ones direction is an exact null vector and only C − 1 factors are needed. For each factor c one
backward pass of the "virtual loss" Σ_n ⟨u_nc, f_n⟩ gives, at every Linear / Conv2d / BatchNorm output,
the output gradient g_nc whose per-example parameter gradient is exactly u_ncᵀ J_n. The squared
per-example gradients are then assembled per layer type without a per-example tensor where possible:

- Linear on (n, in) inputs: Σ_n λ_n (g_n a_nᵀ)² = (λ ⊙ g²)ᵀ (a²), and since a² does not depend on c the
  factors are summed first, G2 = Σ_c λ_c g_c², so there is one matmul per layer per chunk;
- Conv2d: per-example weight gradients (weight sharing over positions makes them full rank), for all
  factors in one batched product with the input unfolded once, in sub-chunks sized by the memory budget;
- BatchNorm (eval): per-example gradients Σ_spatial g ⊙ x̂ and Σ_spatial g (cheap).

The backward passes only ask for gradients with respect to the layer outputs, so autograd skips all
weight-gradient products: for an MLP the whole diagonal costs about one forward plus C − 1 input-gradient
backward passes plus one weight-gradient-sized product per layer (≈ 3 gradients for 784-512-512-10);
conv layers add the per-example products (≈ 7 gradients for LeNet-5, scripts/bench_curvature.py).

Where the premise fails (smooth activations, BatchNorm in train mode, unknown modules, weight sharing)
the diagonal comes from Hutchinson's estimator E[z ⊙ Hz] with Rademacher z, and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp

from flatbench.seeding import make_generator

DEFAULT_HUTCHINSON_PROBES = 100
"""Probes of the Hutchinson fallback diagonal (and of `hutchinson_trace` when neither probes nor rtol)."""

# ---------------------------------------------------------------- applicability

_PARAM_LEAVES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d)
"""Parametrized leaves whose per-example squared gradients this module knows how to assemble."""

_PIECEWISE_LINEAR_LEAVES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Unflatten,
    nn.Identity, nn.ZeroPad2d, nn.ConstantPad2d)
"""Parameter-free leaves that are piecewise linear in their input (second derivative zero a.e.)."""

_DROPOUTS: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout)

_TORCH_CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

_EXTRA_CONTAINERS: set[type[nn.Module]] = set()


def register_piecewise_linear_container(cls: type[nn.Module]) -> type[nn.Module]:
    """Vouch that `cls.forward` only combines its children with piecewise-linear ops (e.g. a residual add).

    A container's forward may do anything (an `F.gelu` between two children would break the exact
    premise silently), so classes outside torch's containers and `flatbench.models` are not trusted
    unless registered here. Usable as a class decorator.
    """
    _EXTRA_CONTAINERS.add(cls)
    return cls


def _is_known_container(module: nn.Module) -> bool:
    cls = type(module)
    return (isinstance(module, _TORCH_CONTAINERS) or cls in _EXTRA_CONTAINERS
            or cls.__module__ == "flatbench.models" or cls.__module__.startswith("flatbench.models."))


def _unmodified_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """A subclass of a known layer is only trusted when it keeps the base class's forward."""
    return getattr(type(module), "forward", None) is getattr(base, "forward")


def exact_applicable(model: nn.Module) -> tuple[bool, str]:
    """Whether the exact-diagonal premise holds for `model`, and if not, why.

    The premise is that the logits are piecewise linear in every single parameter; it is decided by a
    walk over the modules: known parametrized layers (Linear, Conv2d, BatchNorm with running statistics
    in eval mode), piecewise-linear parameter-free leaves, dropout that is inactive, and containers whose
    forward is trusted (torch containers, `flatbench.models` classes, registered classes) that hold no
    parameters of their own. Anything else, or a parameter shared by two modules, means no.
    """
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        where = f"'{name or type(module).__name__}' ({type(module).__name__})"
        direct = list(module.named_parameters(recurse=False))
        for pname, param in direct:
            if id(param) in owners:
                return False, f"parameter {name}.{pname} is shared with {owners[id(param)]} (weight sharing)"
            owners[id(param)] = f"{name}.{pname}"
        base = next((b for b in _PARAM_LEAVES if isinstance(module, b)), None)
        if base is not None:
            if not _unmodified_forward(module, base):
                return False, f"{where} overrides the forward of {base.__name__}"
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                if module.training:
                    return False, f"{where} is in train mode (batch statistics couple the examples)"
                if module.running_mean is None or module.running_var is None:
                    return False, f"{where} has no running statistics (it always uses batch statistics)"
            continue
        if direct:
            return False, f"{where} holds parameters the exact diagonal does not know how to handle"
        if isinstance(module, _PIECEWISE_LINEAR_LEAVES):
            continue
        if isinstance(module, _DROPOUTS):
            if module.training and module.p > 0:
                return False, f"{where} is active (train mode)"
            continue
        if _is_known_container(module):
            continue
        if next(module.children(), None) is None:
            return False, f"{where} is not known to be piecewise linear"
        return False, (f"{where} is a container whose forward is not known to be piecewise linear "
                       f"(see register_piecewise_linear_container)")
    return True, "piecewise linear in every single parameter"


# ---------------------------------------------------------------- results


@dataclass
class DiagonalResult:
    """diag H per parameter (same shapes as the parameters, float64) and how it was obtained."""

    diag: dict[str, Tensor]
    method: str
    """'exact' or 'hutchinson'."""
    stderr: dict[str, Tensor] | None = None
    """Hutchinson only: per-element standard error of the diagonal estimate."""
    probes: int | None = None
    trace_stderr: dict[str, float] | None = None
    """Hutchinson only: standard error of each parameter tensor's trace (from per-probe sums, so
    correlations between elements are accounted for)."""
    total_trace_stderr: float | None = None
    reason: str = ""
    """Why the method was chosen (the applicability verdict)."""
    n: int = 0

    def trace(self) -> float:
        return float(sum(d.sum() for d in self.diag.values()))


def per_layer_traces(result: DiagonalResult) -> dict[str, float]:
    """Tr H restricted to each parameter tensor: the quantity layer-wise measures are built from."""
    return {name: float(d.sum()) for name, d in result.diag.items()}


# ---------------------------------------------------------------- helpers


def _chunks(inputs: Tensor, targets: Tensor, chunk_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(0, int(inputs.shape[0]), max(1, int(chunk_size))):
        yield inputs[i:i + chunk_size], targets[i:i + chunk_size]


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _flatten(tensors: dict[str, Tensor], names: list[str], dtype: torch.dtype | None = None) -> Tensor:
    return torch.cat([tensors[n].reshape(-1).to(dtype or tensors[n].dtype) for n in names])


def _unflatten(flat: Tensor, like: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    offset = 0
    for name, ref in like.items():
        size = ref.numel()
        out[name] = flat[offset:offset + size].view_as(ref).to(dtype or ref.dtype)
        offset += size
    if offset != flat.numel():
        raise ValueError(f"vector has {flat.numel()} entries, the model has {offset} parameters")
    return out


def _rademacher(like: dict[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
    """±1 probes, drawn on the generator's device (so a seed gives the same probes on any machine of
    that device type) and moved to each parameter's device."""
    out = {}
    for name, ref in like.items():
        bits = torch.randint(0, 2, ref.shape, generator=generator, device=generator.device)
        out[name] = (bits * 2 - 1).to(device=ref.device, dtype=ref.dtype)
    return out


class _GradMode:
    """Enable autograd and make every parameter require grad for the duration (measures may run under
    `torch.no_grad()` or on frozen models); restores both afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[Tensor, bool]] = []
        self.ctx = torch.enable_grad()

    def __enter__(self) -> None:
        self.ctx.__enter__()
        for p in self.model.parameters():
            self.saved.append((p, p.requires_grad))
            p.requires_grad_(True)

    def __exit__(self, *exc: Any) -> None:
        for p, flag in self.saved:
            p.requires_grad_(flag)
        self.ctx.__exit__(*exc)


# ---------------------------------------------------------------- Hessian-vector products


def _loss_fn(model: nn.Module, buffers: dict[str, Tensor], x: Tensor, y: Tensor, loss: Callable,
             weight: float) -> Callable[[dict[str, Tensor]], Tensor]:
    """The chunk's share of the mean loss as a function of the parameters (for torch.func)."""
    def fn(params: dict[str, Tensor]) -> Tensor:
        return loss(functional_call(model, (params, buffers), (x,)), y) * weight
    return fn


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    """Buffers for functional_call; cloned when some module is in train mode so that BatchNorm's
    running statistics of the model are not updated by a measurement."""
    bufs = dict(model.named_buffers())
    if any(m.training for m in model.modules()):
        bufs = {k: v.clone() for k, v in bufs.items()}
    return bufs


HVP_MODES = ("rev_fwd", "fwd_rev", "double_backward")


def hvp(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, vec: dict[str, Tensor] | Tensor,
        chunk_size: int = 2000, mode: str = "rev_fwd") -> dict[str, Tensor] | Tensor:
    """H v for H the Hessian of the mean loss over (inputs, targets), with torch.func, in chunks.

    `vec` is a dict of tensors keyed like `model.named_parameters()` or one flat vector in that order;
    the result has the same structure (and the parameters' dtype). Chunks are weighted by their share of
    the examples, so the result is the full-set Hessian's product whatever the chunking.

    `mode`: 'rev_fwd' (default) is `grad` of the directional derivative `jvp(L)[v]` (reverse-over-forward),
    'fwd_rev' is `jvp(grad(L))` (forward-over-reverse), 'double_backward' is PyHessian's
    `autograd.grad(⟨∇L, v⟩)`. All three compute the same product; on CPU the reverse-over-forward form
    measured fastest of the torch.func ones (scripts/bench_curvature.py prints all three), so it is the
    default. A model with a module in train mode (BatchNorm updating running statistics mutates buffers,
    which torch.func transforms refuse) always uses double backward, on cloned buffers so the model's
    statistics are left as they were.
    """
    if mode not in HVP_MODES:
        raise ValueError(f"mode must be one of {HVP_MODES}, got {mode!r}")
    params = _params(model)
    flat_input = isinstance(vec, Tensor)
    v = _unflatten(vec, params) if flat_input else {k: vec[k].to(params[k].dtype) for k in params}
    buffers = _buffers(model)
    n = int(inputs.shape[0])
    out = {k: torch.zeros_like(p) for k, p in params.items()}
    if any(m.training for m in model.modules()):
        mode = "double_backward"
    with torch.enable_grad():
        for x, y in _chunks(inputs, targets, chunk_size):
            fn = _loss_fn(model, buffers, x, y, loss, x.shape[0] / n)
            if mode == "rev_fwd":
                hv = grad(lambda p: jvp(fn, (p,), (v,))[1])(params)
            elif mode == "fwd_rev":
                hv = jvp(grad(fn), (params,), (v,))[1]
            else:
                leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
                grads = torch.autograd.grad(fn(leaves), list(leaves.values()), create_graph=True,
                                            allow_unused=True, materialize_grads=True)
                dot = sum((g * v[k]).sum() for g, k in zip(grads, leaves))
                hv = dict(zip(leaves, torch.autograd.grad(dot, list(leaves.values()), allow_unused=True,
                                                          materialize_grads=True)))
            for k in out:
                out[k] += hv[k]
    if flat_input:
        return _flatten(out, list(params)).to(vec.dtype)
    return out


# ---------------------------------------------------------------- Hutchinson


class _Welford:
    """Running mean and variance in float64 (numerically stable, one pass over the probes)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Any = 0.0
        self.m2: Any = 0.0

    def add(self, x: Any) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean = self.mean + delta / self.count
        self.m2 = self.m2 + delta * (x - self.mean)

    def stderr(self) -> Any:
        if self.count < 2:
            return self.m2 * float("nan") if isinstance(self.m2, Tensor) else float("nan")
        var = self.m2 / (self.count - 1)
        return (var / self.count) ** 0.5


def hutchinson_trace(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, *,
                     generator: torch.Generator, probes: int | None = None, rtol: float | None = None,
                     max_probes: int = 1000, min_probes: int = 10, chunk_size: int = 2000) -> dict[str, Any]:
    """Tr H ≈ mean of zᵀHz over Rademacher probes z, with its standard error.

    With `probes` a fixed count is drawn; otherwise, with `rtol`, probes are drawn until the standard
    error is at most rtol·|mean| (at least `min_probes`, at most `max_probes`); with neither,
    `DEFAULT_HUTCHINSON_PROBES`. Deterministic given the generator's state.
    """
    params = _params(model)
    if probes is None and rtol is None:
        probes = DEFAULT_HUTCHINSON_PROBES
    limit = probes if probes is not None else max_probes
    acc = _Welford()
    while acc.count < limit:
        z = _rademacher(params, generator)
        hz = hvp(model, inputs, targets, loss, z, chunk_size=chunk_size)
        acc.add(float(sum((z[k].double() * hz[k].double()).sum() for k in params)))
        if probes is None and acc.count >= max(2, min_probes) and acc.stderr() <= rtol * abs(acc.mean):
            break
    return {"mean": float(acc.mean), "stderr": float(acc.stderr()), "probes": acc.count}


def _hutchinson_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, *,
                         generator: torch.Generator, probes: int, chunk_size: int, reason: str
                         ) -> DiagonalResult:
    """diag H ≈ mean of z ⊙ Hz (Rademacher z: E[z_i z_j] = δ_ij, so the mean is unbiased), with
    per-element standard errors and per-tensor trace standard errors from the per-probe sums."""
    params = _params(model)
    elem = {k: _Welford() for k in params}
    per_tensor = {k: _Welford() for k in params}
    total = _Welford()
    for _ in range(max(1, probes)):
        z = _rademacher(params, generator)
        hz = hvp(model, inputs, targets, loss, z, chunk_size=chunk_size)
        sample_total = 0.0
        for k in params:
            sample = z[k].double() * hz[k].double()
            elem[k].add(sample)
            s = float(sample.sum())
            per_tensor[k].add(s)
            sample_total += s
        total.add(sample_total)
    stderr = {k: w.stderr() for k, w in elem.items()}
    return DiagonalResult(diag={k: w.mean for k, w in elem.items()}, method="hutchinson", stderr=stderr,
                          probes=total.count,
                          trace_stderr={k: float(w.stderr()) for k, w in per_tensor.items()},
                          total_trace_stderr=float(total.stderr()), reason=reason, n=int(inputs.shape[0]))


# ---------------------------------------------------------------- exact diagonal


class _NotExact(Exception):
    """Raised during the exact computation when a runtime check finds the premise broken."""


@dataclass
class _Record:
    """What one forward call of a parametrized module leaves for the diagonal."""

    module: nn.Module
    kind: str
    """'linear' (2-D input), 'linear_nd', 'conv', 'bn'."""
    out: Tensor
    """The module's output: the tensor the virtual losses are differentiated against."""
    saved: Tensor
    """linear: a² (n, in); linear_nd / conv: the input a; bn: x̂ (the normalized input)."""
    out_version: int
    in_tensor: Tensor | None = None
    in_version: int = 0
    g2: Tensor | None = None
    """linear: Σ_c λ_c g_c², accumulated over the factors."""
    rows: Tensor | None = None
    """conv: the output gradients of all factors, (n, groups, K, O/groups, L), processed together after
    the backward passes."""


@dataclass
class _Accumulator:
    names: dict[int, tuple[str | None, str | None]]
    """id(module) → (weight name, bias name) in model.named_parameters()."""
    diag: dict[str, Tensor]
    budget_bytes: int
    records: list[_Record] = field(default_factory=list)
    safe: bool = False

    def add(self, name: str | None, value: Tensor) -> None:
        if name is not None:
            self.diag[name] += value.reshape(self.diag[name].shape).to(torch.float64)


def _record_hook(acc: _Accumulator) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
        a = args[0]
        if isinstance(module, nn.Linear):
            kind = "linear" if a.dim() == 2 else "linear_nd"
            saved = a.detach() ** 2 if kind == "linear" else a.detach()
        elif isinstance(module, nn.Conv2d):
            kind, saved = "conv", a.detach()
            if a.dim() != 4:
                raise _NotExact(f"Conv2d input without a batch dimension ({a.dim()}-D)")
        else:
            kind = "bn"
            shape = [1, -1] + [1] * (a.dim() - 2)
            scale = torch.rsqrt(module.running_var + module.eps).view(shape)
            saved = (a.detach() - module.running_mean.view(shape)) * scale
        if acc.safe and kind in ("linear_nd", "conv"):
            saved = saved.clone()
        acc.records.append(_Record(module=module, kind=kind, out=out, saved=saved, out_version=out._version,
                                   in_tensor=a if kind in ("linear_nd", "conv") and not acc.safe else None,
                                   in_version=a._version))
        # In safe mode the downstream graph gets a copy, so an in-place op after this module (e.g. an
        # inplace ReLU) cannot change which tensor the virtual-loss gradients are taken against.
        return out.clone() if acc.safe else None
    return hook


def _exact_chunk(model: nn.Module, x: Tensor, y: Tensor, loss: Any, acc: _Accumulator) -> None:
    """Add Σ_{n in chunk} diag(J_nᵀ ∇²ℓ_n J_n) to acc.diag (not yet divided by n)."""
    acc.records = []
    logits = model(x)
    counts: dict[int, int] = {}
    for r in acc.records:
        counts[id(r.module)] = counts.get(id(r.module), 0) + 1
        if counts[id(r.module)] > 1:
            raise _NotExact(f"module {type(r.module).__name__} is called more than once per forward "
                            f"(weight sharing: the logits are not piecewise linear in its parameters)")
    changed = any(r.out._version != r.out_version or
                  (r.in_tensor is not None and r.in_tensor._version != r.in_version) for r in acc.records)
    if changed and not acc.safe:
        acc.safe = True  # an in-place op touched a recorded tensor: redo this and later chunks with copies
        _exact_chunk(model, x, y, loss, acc)
        return
    if changed:
        raise _NotExact("a recorded layer output is modified in place even after copying")
    if logits.dim() != 2:
        raise _NotExact(f"the model output has shape {tuple(logits.shape)}, expected (n, C) logits")
    lam, vecs = _logit_factors(loss, logits.detach(), y)
    lam = lam.to(logits.dtype)
    vecs = vecs.to(logits.dtype)
    records = [r for r in acc.records if r.out.requires_grad]
    outs = [r.out for r in records]
    if not outs:
        acc.records = []
        return
    active = [c for c in range(lam.shape[1]) if bool(lam[:, c].abs().max() > 0)]
    for i, c in enumerate(active):
        grads = torch.autograd.grad(logits, outs, grad_outputs=vecs[:, :, c],
                                    retain_graph=i < len(active) - 1, allow_unused=True,
                                    materialize_grads=True)
        lam_c = lam[:, c]
        for r, g in zip(records, grads):
            if r.kind == "conv":
                if r.rows is None:
                    groups = r.module.groups  # type: ignore[union-attr]
                    r.rows = g.new_empty(g.shape[0], groups, len(active), g.shape[1] // groups,
                                         g.shape[2] * g.shape[3])
                r.rows[:, :, i] = g.reshape(g.shape[0], r.rows.shape[1], r.rows.shape[3], -1)
            else:
                _accumulate(r, g, lam_c, acc)
    for r in records:
        w_name, b_name = acc.names[id(r.module)]
        if r.kind == "linear" and r.g2 is not None:
            acc.add(w_name, r.g2.t() @ r.saved)
            acc.add(b_name, r.g2.sum(0))
        elif r.kind == "conv" and r.rows is not None:
            _conv(r, r.rows, lam[:, active], acc, w_name, b_name)
            r.rows = None
    acc.records = []


def _logit_factors(loss: Any, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Signed factors (λ (n, K), U (n, C, K)) of the per-example logit Hessians, in float64.

    When every Hessian annihilates the all-ones vector (true for `ce` and `normalized_ce`, which are
    shift invariant; checked numerically rather than assumed), the eigendecomposition is taken on the
    orthogonal complement of 1, so K = C − 1 and one backward pass is saved.
    """
    hess = loss.logit_hessian(logits.double(), targets)
    hess = 0.5 * (hess + hess.transpose(-1, -2))
    num_classes = hess.shape[-1]
    ones = torch.ones(num_classes, dtype=hess.dtype, device=hess.device)
    scale = hess.abs().amax().clamp_min(torch.finfo(hess.dtype).tiny)
    if num_classes > 1 and bool((hess @ ones).abs().amax() <= 1e-10 * scale):
        # Orthonormal basis of 1^⊥ from the QR of [1 | I].
        basis, _ = torch.linalg.qr(torch.cat([ones[:, None], torch.eye(num_classes, dtype=hess.dtype,
                                                                        device=hess.device)], dim=1))
        q = basis[:, 1:num_classes]
        lam, v = torch.linalg.eigh(q.t() @ hess @ q)
        return lam, q @ v
    return torch.linalg.eigh(hess)


def _accumulate(r: _Record, g: Tensor, lam_c: Tensor, acc: _Accumulator) -> None:
    """Add Σ_n λ_nc (per-example gradient of factor c)² for one recorded module."""
    w_name, b_name = acc.names[id(r.module)]
    if r.kind == "linear":
        term = lam_c[:, None] * g * g
        r.g2 = term if r.g2 is None else r.g2 + term
    elif r.kind == "bn":
        dims = tuple(range(2, g.dim()))
        gw = (g * r.saved).sum(dims) if dims else g * r.saved
        gb = g.sum(dims) if dims else g
        acc.add(w_name, lam_c @ (gw * gw))
        acc.add(b_name, lam_c @ (gb * gb))
    else:
        _linear_nd(r, g, lam_c, acc, w_name, b_name)


def _sub_chunk(per_example_bytes: int, n: int, budget_bytes: int) -> int:
    return max(1, min(n, budget_bytes // max(1, per_example_bytes)))


def _linear_nd(r: _Record, g: Tensor, lam_c: Tensor, acc: _Accumulator, w_name: str | None,
               b_name: str | None) -> None:
    """Linear applied to (n, ..., in): the per-example gradient Σ_t g_t a_tᵀ is not rank one, so it is
    materialized in sub-chunks."""
    a = r.saved.reshape(r.saved.shape[0], -1, r.saved.shape[-1])
    gg = g.reshape(g.shape[0], -1, g.shape[-1])
    n = a.shape[0]
    per_ex = (gg.shape[-1] * a.shape[-1] * 2 + a[0].numel() + gg[0].numel()) * a.element_size()
    step = _sub_chunk(per_ex, n, acc.budget_bytes)
    for i in range(0, n, step):
        pe = torch.einsum("nto,nti->noi", gg[i:i + step], a[i:i + step])
        acc.add(w_name, torch.einsum("n,noi->oi", lam_c[i:i + step], pe * pe))
        gb = gg[i:i + step].sum(1)
        acc.add(b_name, lam_c[i:i + step] @ (gb * gb))


def _conv(r: _Record, rows: Tensor, lam: Tensor, acc: _Accumulator, w_name: str | None,
          b_name: str | None) -> None:
    """Conv2d: Σ_c Σ_n λ_nc (per-example gradient of factor c)², all factors at once, in sub-chunks.

    `rows` (n, groups, K, O/groups, L) holds the output gradients of the K factors, `lam` (n, K) their
    weights. The per-example weight gradient is g_n (O × L) times the unfolded input (L × C_in·kh·kw);
    stacking the factors as rows makes that one batched (K·O × L)(L × C_in·kh·kw) product per example
    instead of K thin ones, and the input is unfolded once for all factors (by strided copies:
    `F.unfold` is slow on CPU).
    """
    conv: nn.Conv2d = r.module  # type: ignore[assignment]
    a = r.saved
    n, groups, num_f, out_g, spatial = rows.shape
    in_c = conv.in_channels
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    k = (in_c // groups) * kh * kw
    pad = conv._reversed_padding_repeated_twice
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    a_pad = F.pad(a[:1], pad, mode=mode) if any(pad) else a[:1]
    ho = (a_pad.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (a_pad.shape[3] - dw * (kw - 1) - 1) // sw + 1
    if ho * wo != spatial:
        raise _NotExact("Conv2d output size does not match its input")
    per_ex = (in_c * kh * kw * spatial + 2 * num_f * groups * out_g * k + a_pad[0].numel()) * a.element_size()
    step = _sub_chunk(per_ex, n, acc.budget_bytes)
    for i0 in range(0, n, step):
        ri = rows[i0:i0 + step]
        s = ri.shape[0]
        lam_i = lam[i0:i0 + step]
        if b_name is not None:
            gb = ri.sum(-1)
            acc.add(b_name, torch.einsum("nc,ngco->go", lam_i, gb * gb))
        if w_name is None:
            continue
        ai = a[i0:i0 + step]
        if any(pad):
            ai = F.pad(ai, pad, mode=mode)
        cols = torch.empty(s, in_c, kh, kw, ho, wo, dtype=a.dtype, device=a.device)
        for i in range(kh):
            rows_i = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            for j in range(kw):
                cols[:, :, i, j] = ai[:, :, rows_i, j * dw:j * dw + sw * (wo - 1) + 1:sw]
        cols = cols.view(s, groups, k, spatial)
        pe = torch.matmul(ri.reshape(s, groups, num_f * out_g, spatial), cols.transpose(-1, -2))
        pe = pe.view(s, groups, num_f, out_g, k)
        acc.add(w_name, torch.einsum("nc,ngcok->gok", lam_i, pe * pe))


def _bytes_per_example(model: nn.Module, x: Tensor) -> int:
    """Memory one example of a chunk needs, from a probe forward on two examples: autograd keeps ~2 copies
    of the activations, one factor's gradients a third, Linear accumulators and safe-mode copies a fourth;
    the gradients of all C factors are kept at every Conv2d output."""
    acts = [0, 0]

    def hook(m: nn.Module, _a: tuple, out: Any) -> None:
        if isinstance(out, Tensor):
            acts[0] += out.numel() * out.element_size()
            if isinstance(m, nn.Conv2d):
                acts[1] += out.numel() * out.element_size()

    handles = [m.register_forward_hook(hook) for m in model.modules() if next(m.children(), None) is None]
    try:
        with torch.no_grad():
            logits = model(x[:2])
    finally:
        for h in handles:
            h.remove()
    probe = max(1, min(2, int(x.shape[0])))
    num_classes = int(logits.shape[-1]) if logits.dim() == 2 else 1
    return max(1, (4 * acts[0] + num_classes * acts[1]) // probe)


def _exact_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Any, *, max_memory_mb: int,
                    chunk_size: int) -> DiagonalResult:
    names: dict[int, tuple[str | None, str | None]] = {}
    covered: set[str] = set()
    param_names = {id(p): n for n, p in model.named_parameters()}
    modules = [m for m in model.modules() if isinstance(m, _PARAM_LEAVES)
               and any(p is not None for p in (getattr(m, "weight", None), getattr(m, "bias", None)))]
    for m in modules:
        w = param_names.get(id(m.weight)) if getattr(m, "weight", None) is not None else None
        b = param_names.get(id(m.bias)) if getattr(m, "bias", None) is not None else None
        names[id(m)] = (w, b)
        covered.update(x for x in (w, b) if x is not None)
    missing = [n for n in param_names.values() if n not in covered]
    if missing:
        raise _NotExact(f"parameters not owned by a Linear/Conv2d/BatchNorm layer: {missing[:3]}")
    budget = int(max_memory_mb) * 2 ** 20
    diag = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    acc = _Accumulator(names=names, diag=diag, budget_bytes=budget)
    step = max(1, min(int(chunk_size), budget // _bytes_per_example(model, inputs)))
    handles = [m.register_forward_hook(_record_hook(acc)) for m in modules]
    try:
        with _GradMode(model):
            for x, y in _chunks(inputs, targets, step):
                _exact_chunk(model, x, y, loss, acc)
    finally:
        for h in handles:
            h.remove()
        acc.records = []
    n = int(inputs.shape[0])
    return DiagonalResult(diag={k: v / n for k, v in diag.items()}, method="exact",
                          reason="piecewise linear in every single parameter", n=n)


def hessian_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Any, *,
                     max_memory_mb: int = 1024, chunk_size: int = 2000,
                     generator: torch.Generator | None = None,
                     hutchinson_probes: int = DEFAULT_HUTCHINSON_PROBES, method: str = "auto"
                     ) -> DiagonalResult:
    """diag H of the mean loss over (inputs, targets): exact where the premise holds, else Hutchinson.

    `method` is 'auto' (exact when `exact_applicable`, otherwise Hutchinson), 'exact' (raises ValueError
    when not applicable) or 'hutchinson'. `loss` is a `flatbench.losses.LogitLoss` (it must provide
    `logit_hessian` for the exact path). The generator is only used by Hutchinson; without one a fixed
    seed is used so results stay reproducible.
    """
    if method not in ("auto", "exact", "hutchinson"):
        raise ValueError(f"method must be auto, exact or hutchinson, got {method!r}")
    ok, reason = exact_applicable(model)
    if method == "exact" and not ok:
        raise ValueError(f"exact Hessian diagonal not applicable: {reason}")
    if ok and method != "hutchinson":
        try:
            return _exact_diagonal(model, inputs, targets, loss, max_memory_mb=max_memory_mb,
                                   chunk_size=chunk_size)
        except _NotExact as exc:
            if method == "exact":
                raise ValueError(f"exact Hessian diagonal not applicable: {exc}") from None
            reason = str(exc)
    elif method == "hutchinson" and ok:
        reason = "hutchinson requested"
    if generator is None:
        generator = make_generator("hessian_diagonal", "default", device=inputs.device)
    return _hutchinson_diagonal(model, inputs, targets, loss, generator=generator, probes=hutchinson_probes,
                                chunk_size=chunk_size, reason=reason)


def diagonal_for(ctx: Any) -> DiagonalResult:
    """The Hessian diagonal for a `MeasureContext`, computed once per (model, loss) and shared.

    The Hutchinson fallback's generator is derived from the run, not from the calling measure, so the
    cached value does not depend on which measure asked first.
    """
    def compute() -> DiagonalResult:
        gen = make_generator("measure", ctx.run_id, ctx.seed, "hessian_diagonal", ctx.loss_name,
                             ctx.normalized_ce_tau, device=ctx.device)
        return hessian_diagonal(ctx.model, ctx.inputs, ctx.targets, ctx.loss, max_memory_mb=ctx.max_memory_mb,
                                chunk_size=ctx.chunk_size, generator=gen)

    return ctx.cached(("hessian_diagonal", ctx.loss_name, ctx.normalized_ce_tau), compute)


# ---------------------------------------------------------------- Lanczos


def lanczos(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Callable, *, k: int = 1,
            iters: int = 100, generator: torch.Generator, tol: float = 1e-6, chunk_size: int = 2000
            ) -> dict[str, Any]:
    """The k largest (algebraic) eigenvalues of H by Lanczos with full reorthogonalization.

    Stops when every wanted Ritz pair has residual ‖Hy − θy‖ = β_m |s_m| ≤ tol·max_i |θ_i| (an eigenvalue
    lies within the residual of θ, and θ is within residual²/gap of it; the scale is the largest wanted
    Ritz value, so for k = 1 the test is relative to λ_max itself), when the Krylov space is invariant
    (the Ritz values are then exact), or after `iters` steps (at most the number of parameters); the
    result says whether it converged. The Lanczos vectors are kept in float64
    (memory iters × P × 8 bytes) so that reorthogonalization is exact to double precision; the HVPs run
    in the model's dtype. Deterministic given the generator's state (one Gaussian start vector).
    """
    params = _params(model)
    names = list(params)
    size = sum(p.numel() for p in params.values())
    device = next(iter(params.values())).device
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
        w = hvp(model, inputs, targets, loss, _unflatten(basis[j], params), chunk_size=chunk_size)
        w = _flatten(w, names, torch.float64)
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
