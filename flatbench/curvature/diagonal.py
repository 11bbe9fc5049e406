"""The exact Hessian diagonal of a loss on the logits, for piecewise-linear networks.

**Exact diagonal.** For a network whose logits are piecewise linear in every *single* parameter (Linear,
Conv2d, ReLU, max/avg pooling, flatten, residual additions, BatchNorm with running statistics),
`∂²f/∂θ_k² = 0` almost everywhere, so for a loss ℓ on the logits

    H_kk = (1/n) Σ_n J_n[:,k]ᵀ ∇²_f ℓ_n J_n[:,k] = (1/n) Σ_n Σ_c s_nc (v_ncᵀ J_n[:,k])²

for any signed factorization ∇²_f ℓ_n = Σ_c s_nc v_nc v_ncᵀ, s = ±1 (the logit Hessian of `normalized_ce` is
indefinite). Both losses are unchanged by adding a constant to all logits, so the all-ones direction is an
exact null vector and only C − 1 factors are needed: on its orthonormal complement the (C−1)×(C−1)
Hessian is factored by a batched Cholesky (all s = +1; ~20× cheaper than an eigendecomposition), with
the eigendecomposition (√|λ| folded into v, s = sign λ) for the rows where Cholesky fails (indefinite or
numerically singular). For each factor c one backward pass of the "virtual loss" Σ_n ⟨v_nc, f_n⟩ gives,
at every Linear / Conv2d / BatchNorm output, the output gradient g_nc whose per-example parameter
gradient is exactly v_ncᵀ J_n. The backward passes only ask for gradients with respect to the layer
outputs, so autograd skips all weight-gradient products. The squared per-example gradients are then
assembled per layer type without a per-example tensor where possible:

- Linear on (n, in) inputs: Σ_n s_n (g_n a_nᵀ)² = (s ⊙ g²)ᵀ (a²), and since a² does not depend on c the
  factors are summed first, G2 = Σ_c s_c g_c², so there is one matmul per layer per chunk; for the Linear
  that produces the logits G2 = Σ_c s_c v_c² in closed form (its output gradient is the factor itself);
- Conv2d: per-example weight gradients (weight sharing over positions makes them full rank), with the
  input unfolded once per chunk (one strided copy of an `as_strided` view). Per layer, whichever buffer is
  smaller: the unfolded input, multiplied with each factor's output gradient as it arrives ("streamed",
  e.g. LeNet's 1-channel first layer), or the output gradients of all factors, stacked into one batched
  (K·O × L)(L × C_in·kh·kw) product per example after the backward passes ("stacked");
- BatchNorm (eval): per-example gradients Σ_spatial g ⊙ x̂ and Σ_spatial g (cheap).

One backward pass per factor (C − 1 of them) measured faster on CPU than one vmapped pass over all factors
(`_BATCHED_BACKWARD`, kept as a tested option): the MLP's matmuls are already large at 2,000 rows, and the
vmapped convolution and max-pool backward loop over the factors anyway. On CPU the chunks are kept small
enough that one chunk's activations fit in 16 MiB (`_CPU_CHUNK_BYTES`), which halved LeNet-5's time.

Cost (scripts/bench_curvature.py --n 2000 --only diagonal, MNIST, float32, 2 CPU threads, in gradients
of the mean loss over the set taken in chunks of 2,000): MLP 784-512-512-10 ≈ 2.8 (its FLOP floor, forward
+ 9 factor backprops + one weight-sized product per layer, is 2.33 gradients' FLOPs); LeNet-5 ≈ 3.2 (FLOP
floor 5.6 gradients' FLOPs: the per-example conv products and the 9 backprops through the second conv
dominate); BackPACK's `DiagGGNExact` ≈ 6.9 and 6.6 in the same run. Part of LeNet's gain is the small
chunks, which also speed up the gradient and BackPACK: with --chunk-size 250 for all of them it is MLP
≈ 2.8 and LeNet ≈ 7.3 gradients against BackPACK's 4.4 and 9.5.

Which networks qualify is decided in `curvature.applicability`. Where the premise fails,
`HessianOperator.diagonal` uses the exact recursion with second-derivative terms for Sequential chains with
smooth activations (`curvature.smooth`), else (BatchNorm in train mode, unknown modules, weight sharing)
Hutchinson's estimator E[z ⊙ Hz] with Rademacher z, and the result says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flatbench.curvature.applicability import PARAM_LEAVES
from flatbench.curvature.common import GradMode, chunks, require_graph

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


# ---------------------------------------------------------------- exact diagonal


class NotExact(Exception):
    """Raised during the exact computation when a runtime check finds the premise broken."""


_BATCHED_BACKWARD = False
"""Whether the exact diagonal takes one vmapped backward pass over all factors (True) rather than one
pass per factor (False, the default: on CPU the batched pass measured no faster for MLPs, whose matmuls
are already large at n = 2000, and slower for conv nets, whose vmapped convolution and max-pool backward
loop over the factors and concatenate). Both are exact and tested."""


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
    """linear: Σ_k s_k g_k², accumulated over the factors."""
    cols: Tensor | None = None
    """conv, streamed: the unfolded input (n, groups, C_in/groups·kh·kw, L), made once per chunk."""
    rows: Tensor | None = None
    """conv, stacked: the output gradients of all factors, (n, groups, K, O/groups, L), processed together
    after the backward passes."""


@dataclass
class _Accumulator:
    names: dict[int, tuple[str | None, str | None]]
    """id(module) → (weight name, bias name) in model.named_parameters()."""
    diag: dict[str, Tensor]
    budget_bytes: int
    records: list[_Record] = field(default_factory=list)
    safe: bool = False
    batched: bool = False
    """One backward pass over all factors at once (`is_grads_batched`) rather than one per factor."""

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
                raise NotExact(f"Conv2d input without a batch dimension ({a.dim()}-D)")
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


def _scaled_factors(loss: Any, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
    """(V (n, C, K), signs (n, K) or None) with ∇²_f ℓ_n = Σ_k s_nk v_nk v_nkᵀ, in float64.

    When every Hessian annihilates the all-ones vector (true for `ce` and `normalized_ce`, which are
    shift invariant; checked numerically rather than assumed), the factorization is taken on the
    orthonormal complement Q of 1, so K = C − 1 and one backward pass is saved. There the (C−1)×(C−1)
    matrix M = QᵀHQ is factored by Cholesky, M = LLᵀ, v_k = Q L[:, k], s_k = +1 (for `ce` M is positive
    definite unless the softmax saturates); the rows where Cholesky fails (indefinite, as for
    `normalized_ce`, or numerically singular) use the eigendecomposition M = W diag(λ) Wᵀ,
    v_k = Q w_k √|λ_k|, s_k = sign λ_k. signs is None when every s_nk is +1. Both are backward-stable
    factorizations in float64; batched Cholesky is ~20× cheaper than eigh here. (A saturated softmax's
    Hessian, p − p² on the diagonal, is rounding noise that can come out indefinite at the 1e-17 level: its
    rows then take the signed path, harmlessly.)
    """
    hess = loss.logit_hessian(logits.double(), targets)
    hess = 0.5 * (hess + hess.transpose(-1, -2))
    n, num_classes = int(hess.shape[0]), int(hess.shape[-1])
    ones = torch.ones(num_classes, dtype=hess.dtype, device=hess.device)
    scale = hess.abs().amax().clamp_min(torch.finfo(hess.dtype).tiny)
    q: Tensor | None = None
    mat = hess
    if num_classes > 1 and bool((hess @ ones).abs().amax() <= 1e-10 * scale):
        # Orthonormal basis of 1^⊥ from the QR of [1 | I].
        basis, _ = torch.linalg.qr(torch.cat([ones[:, None], torch.eye(num_classes, dtype=hess.dtype,
                                                                        device=hess.device)], dim=1))
        q = basis[:, 1:num_classes]
        k = num_classes - 1
        hq = (hess.reshape(n * num_classes, num_classes) @ q).view(n, num_classes, k)  # H Q
        mat = (hq.transpose(1, 2).reshape(n * k, num_classes) @ q).view(n, k, k)  # (HQ)ᵀQ = QᵀHQ
        mat = 0.5 * (mat + mat.transpose(1, 2))
    factor, info = torch.linalg.cholesky_ex(mat)
    signs: Tensor | None = None
    failed = info != 0
    if bool(failed.any()):
        lam, w = torch.linalg.eigh(mat[failed])
        # Eigenvalues within rounding of zero, relative to their own row (rows can differ by many orders of
        # magnitude, e.g. normalized_ce's), are zero: M carries errors of that size anyway.
        tiny = lam.abs().amax(-1, keepdim=True) * (16 * num_classes * torch.finfo(lam.dtype).eps)
        lam = torch.where(lam.abs() <= tiny, torch.zeros_like(lam), lam)
        factor = factor.clone()
        factor[failed] = w * lam.abs().sqrt().unsqueeze(-2)
        if bool((lam < 0).any()):
            signs = torch.ones(factor.shape[0], factor.shape[-1], dtype=factor.dtype, device=factor.device)
            signs[failed] = torch.where(lam < 0, -1.0, 1.0).to(signs.dtype)
    if q is not None:
        k = factor.shape[-1]
        factor = (factor.transpose(1, 2).reshape(n * k, k) @ q.t()).view(n, k, num_classes).transpose(1, 2)
    return factor, signs


def logit_factors(loss: Any, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Signed factors (λ (n, K), U (n, C, K)) with ∇²_f ℓ_n = Σ_k λ_nk u_nk u_nkᵀ, in float64.

    The factors of `_scaled_factors` with λ = ±1 (the columns are not orthonormal).
    """
    vecs, signs = _scaled_factors(loss, logits, targets)
    lam = signs if signs is not None else torch.ones(vecs.shape[0], vecs.shape[-1], dtype=vecs.dtype,
                                                     device=vecs.device)
    return lam, vecs


def _signed_square_sum(g: Tensor, signs: Tensor | None, dim: int = 0) -> Tensor:
    """Σ s g² over `dim` of g; signs (or None: all +1) has g's leading dims and broadcasts over the rest."""
    sq = g * g
    if signs is not None:
        sq = sq * signs.view(signs.shape + (1,) * (g.dim() - signs.dim()))
    return sq.sum(dim)


def _sub_chunk(per_example_bytes: int, n: int, budget_bytes: int) -> int:
    return max(1, min(n, budget_bytes // max(1, per_example_bytes)))


def _linear_weights(r: _Record, g2: Tensor, acc: _Accumulator) -> None:
    """Linear on (n, in): Σ_n (Σ_k s_k g_nk²) a_n² for the weight (one matmul for all factors, since a²
    does not depend on the factor), Σ_n Σ_k s_k g_nk² for the bias."""
    w_name, b_name = acc.names[id(r.module)]
    if w_name is not None:
        acc.add(w_name, g2.t() @ r.saved)
    acc.add(b_name, g2.sum(0))


def _accumulate_block(r: _Record, g: Tensor, signs: Tensor | None, acc: _Accumulator) -> None:
    """BatchNorm and Linear on (n, ..., in): add Σ_k Σ_n s_nk (per-example gradient of factor k)² for
    the output gradients g (K', n, ...) of a block of factors, signs (K', n) or None."""
    w_name, b_name = acc.names[id(r.module)]
    if r.kind == "bn":
        dims = tuple(range(3, g.dim()))
        gw = (g * r.saved).sum(dims) if dims else g * r.saved
        gb = g.sum(dims) if dims else g
        acc.add(w_name, _signed_square_sum(gw, signs).sum(0))
        acc.add(b_name, _signed_square_sum(gb, signs).sum(0))
        return
    # linear_nd: the per-example gradient Σ_t g_t a_tᵀ is not rank one, so it is materialized in sub-chunks
    num_f = g.shape[0]
    a = r.saved.reshape(r.saved.shape[0], -1, r.saved.shape[-1])
    gg = g.reshape(num_f, g.shape[1], -1, g.shape[-1])
    n = a.shape[0]
    per_ex = (num_f * gg.shape[-1] * a.shape[-1] * 2 + a[0].numel() + num_f * gg[0, 0].numel())
    per_ex *= a.element_size()
    step = _sub_chunk(per_ex, n, acc.budget_bytes)
    for i in range(0, n, step):
        s_i = None if signs is None else signs[:, i:i + step]
        pe = torch.einsum("knto,nti->knoi", gg[:, i:i + step], a[i:i + step])
        acc.add(w_name, _signed_square_sum(pe, s_i).sum(0))
        acc.add(b_name, _signed_square_sum(gg[:, i:i + step].sum(2), s_i).sum(0))


def _unfold(conv: nn.Conv2d, a: Tensor, spatial: int) -> Tensor:
    """The input of `conv` unfolded, (n, groups, C_in/groups·kh·kw, L), by one strided copy of an
    `as_strided` view (`F.unfold` is slower on CPU; a 1×1 conv with stride 1 and no padding needs none)."""
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    pad = conv._reversed_padding_repeated_twice
    if any(pad):
        a = F.pad(a, pad, mode="constant" if conv.padding_mode == "zeros" else conv.padding_mode)
    ho = (a.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (a.shape[3] - dw * (kw - 1) - 1) // sw + 1
    if ho * wo != spatial:
        raise NotExact("Conv2d output size does not match its input")
    st = a.stride()
    cols = a.as_strided((a.shape[0], a.shape[1], kh, kw, ho, wo),
                        (st[0], st[1], st[2] * dh, st[3] * dw, st[2] * sh, st[3] * sw))
    return cols.reshape(a.shape[0], conv.groups, -1, spatial)


def _conv_streams(conv: nn.Conv2d, num_f: int) -> bool:
    """Stream (multiply each factor's output gradient with the input unfolded once) when the unfolded
    input is smaller than the K factors' output gradients (C_in·kh·kw < K·O, e.g. LeNet's first layer),
    else stack the factors (`_conv_stacked`). Each choice is the one with the smaller buffer, and it
    measured the faster one on CPU."""
    return conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1] < num_f * conv.out_channels


def _conv_factor(r: _Record, i: int, num_f: int, g: Tensor, signs: Tensor | None, acc: _Accumulator) -> None:
    """Conv2d, output gradient g (n, O, ho, wo) of factor i with signs (n,) or None."""
    conv: nn.Conv2d = r.module  # type: ignore[assignment]
    n, groups, spatial = g.shape[0], conv.groups, g.shape[2] * g.shape[3]
    out_g = g.shape[1] // groups
    if r.cols is None and r.rows is None:
        if _conv_streams(conv, num_f):
            r.cols = _unfold(conv, r.saved, spatial)
        else:
            r.rows = g.new_empty(n, groups, num_f, out_g, spatial)
    if r.rows is not None:
        r.rows[:, :, i] = g.reshape(n, groups, out_g, spatial)
        return
    w_name, b_name = acc.names[id(r.module)]
    gv = g.reshape(n, groups, out_g, spatial)
    acc.add(b_name, _signed_square_sum(gv.sum(-1), signs))
    if w_name is None:
        return
    cols = r.cols
    assert cols is not None
    step = _sub_chunk(2 * cols[0].shape[1] * groups * out_g * g.element_size(), n, acc.budget_bytes)
    for i0 in range(0, n, step):
        # per-example weight gradients, (s, groups, C_in/groups·kh·kw, O/groups)
        pe = torch.matmul(cols[i0:i0 + step], gv[i0:i0 + step].transpose(-1, -2)).square_()
        if signs is not None:
            pe.mul_(signs[i0:i0 + step].view(-1, 1, 1, 1))
        acc.add(w_name, pe.sum(0).transpose(-1, -2))


def _conv_stacked(r: _Record, rows: Tensor, signs: Tensor | None, acc: _Accumulator) -> None:
    """Conv2d: Σ_k Σ_n s_nk (per-example gradient of factor k)², all factors at once, in sub-chunks.

    `rows` (n, groups, K, O/groups, L) holds the output gradients of the K factors, `signs` (n, K) their
    signs (None: all +1). The per-example weight gradient is g_n (O × L) times the unfolded input
    (L × C_in·kh·kw); stacking the factors as rows makes that one batched (K·O × L)(L × C_in·kh·kw)
    product per example instead of K thin ones, with the input unfolded once for all factors.
    """
    conv: nn.Conv2d = r.module  # type: ignore[assignment]
    w_name, b_name = acc.names[id(r.module)]
    a = r.saved
    n, groups, num_f, out_g, spatial = rows.shape
    k = conv.in_channels // groups * conv.kernel_size[0] * conv.kernel_size[1]
    per_ex = (groups * k * spatial + 2 * num_f * groups * out_g * k + a[0].numel()) * a.element_size()
    step = _sub_chunk(per_ex, n, acc.budget_bytes)
    for i0 in range(0, n, step):
        ri = rows[i0:i0 + step]
        s = ri.shape[0]
        s_i = None if signs is None else signs[i0:i0 + step, None, :]  # (s, 1, K): broadcast over groups
        acc.add(b_name, _signed_square_sum(ri.sum(-1), s_i, dim=2).sum(0))
        if w_name is None:
            continue
        cols = _unfold(conv, a[i0:i0 + step], spatial)
        pe = torch.matmul(ri.reshape(s, groups, num_f * out_g, spatial), cols.transpose(-1, -2))
        pe = pe.view(s, groups, num_f, out_g, k).square_()
        if s_i is not None:
            pe.mul_(s_i[..., None, None])
        acc.add(w_name, pe.sum((0, 2)))


def _exact_chunk(model: nn.Module, x: Tensor, y: Tensor, loss: Any, acc: _Accumulator) -> None:
    """Add Σ_{n in chunk} diag(J_nᵀ ∇²ℓ_n J_n) to acc.diag (not yet divided by n)."""
    acc.records = []
    logits = require_graph(model(x), model)
    counts: dict[int, int] = {}
    for r in acc.records:
        counts[id(r.module)] = counts.get(id(r.module), 0) + 1
        if counts[id(r.module)] > 1:
            raise NotExact(f"module {type(r.module).__name__} is called more than once per forward "
                            f"(weight sharing: the logits are not piecewise linear in its parameters)")
    changed = any(r.out._version != r.out_version or
                  (r.in_tensor is not None and r.in_tensor._version != r.in_version) for r in acc.records)
    if changed and not acc.safe:
        acc.safe = True  # an in-place op touched a recorded tensor: redo this and later chunks with copies
        _exact_chunk(model, x, y, loss, acc)
        return
    if changed:
        raise NotExact("a recorded layer output is modified in place even after copying")
    if logits.dim() != 2:
        raise NotExact(f"the model output has shape {tuple(logits.shape)}, expected (n, C) logits")
    records = [r for r in acc.records if r.out.requires_grad]
    acc.records = []
    vecs, signs = _scaled_factors(loss, logits.detach(), y)
    live = vecs.abs().amax(dim=(0, 1)) > 0  # factors that vanish for every example need no pass
    if not bool(live.all()):
        vecs, signs = vecs[:, :, live], None if signs is None else signs[:, live]
    vecs = vecs.to(logits.dtype)
    signs = None if signs is None else signs.to(logits.dtype)
    num_f = int(vecs.shape[-1])
    if not records or num_f == 0:
        return
    # Closed form for a Linear that produces the logits: its output gradient for factor k is v_k itself,
    # so Σ_k s_k g_k² = Σ_k s_k v_k² (the diagonal of ∇²ℓ_n) needs no backward pass.
    rest = []
    for r in records:
        if r.kind == "linear" and r.out is logits:
            _linear_weights(r, _signed_square_sum(vecs, None if signs is None else signs[:, None, :], dim=2),
                            acc)
        else:
            rest.append(r)
    if not rest:
        return
    outs = [r.out for r in rest]
    try:
        if acc.batched:
            # One backward pass for all K factors (vmap over the factor dimension).
            grads = torch.autograd.grad(logits, outs, grad_outputs=vecs.permute(2, 0, 1).contiguous(),
                                        is_grads_batched=True, allow_unused=True, materialize_grads=True)
            signs_t = None if signs is None else signs.t()
            for r, g in zip(rest, grads):
                if r.kind == "linear":
                    _linear_weights(r, _signed_square_sum(g, signs_t), acc)
                elif r.kind == "conv":
                    for i in range(num_f):
                        _conv_factor(r, i, num_f, g[i], None if signs is None else signs[:, i], acc)
                else:
                    _accumulate_block(r, g, signs_t, acc)
        else:
            for i in range(num_f):
                grads = torch.autograd.grad(logits, outs, grad_outputs=vecs[:, :, i].contiguous(),
                                            retain_graph=i < num_f - 1, allow_unused=True,
                                            materialize_grads=True)
                s_i = None if signs is None else signs[:, i]
                for r, g in zip(rest, grads):
                    if r.kind == "linear":
                        gs = g if s_i is None else g * s_i[:, None]
                        r.g2 = gs * g if r.g2 is None else r.g2.addcmul_(gs, g)
                    elif r.kind == "conv":
                        _conv_factor(r, i, num_f, g, s_i, acc)
                    else:
                        _accumulate_block(r, g[None], None if s_i is None else s_i[None], acc)
        for r in rest:
            if r.g2 is not None:
                _linear_weights(r, r.g2, acc)
            if r.rows is not None:
                _conv_stacked(r, r.rows, signs, acc)
    finally:
        for r in rest:
            r.g2 = r.rows = r.cols = None


_CPU_CHUNK_BYTES = 16 * 2 ** 20
"""On CPU the exact diagonal's chunks are also capped so that one chunk's activations (every leaf module's
output) stay within this: each factor's backward pass allocates activation-sized gradients, and above
glibc's mmap threshold (≤ 32 MiB) every one of them is a fresh mapping, page-faulted in and zeroed by the
kernel, and out of cache. At n = 2000, MNIST, one thread: LeNet-5's diagonal 1.10 s in chunks of 2000,
0.63 s in chunks of 250 (this cap: 280); the MLP 784-512-512-10 0.17 s and 0.155 s (cap: 1480); a
WRN-16-4 on CIFAR shapes is as fast in chunks of 4 as of 64."""


def _chunk_size(model: nn.Module, x: Tensor, batched: bool, chunk_size: int, budget_bytes: int) -> int:
    """Examples per chunk: at most `chunk_size`, within the memory budget, and on CPU within
    `_CPU_CHUNK_BYTES` of activations.

    The memory one example needs comes from a probe forward on two examples: autograd keeps ~2 copies of
    the activations, one factor's gradients a third, Linear accumulators and safe-mode copies a fourth;
    each Conv2d keeps its unfolded input or the output gradients of all C factors (`_conv_streams`,
    whichever is smaller); the batched backward keeps the C factors' gradients at every parametrized
    layer's output, plus two of the largest activation in flight."""
    acts = [0, 0, 0, 0]  # all leaves, Conv2d buffers, parametrized outputs, largest
    num_classes = 1

    def hook(m: nn.Module, _a: tuple, out: Any) -> None:
        if isinstance(out, Tensor):
            size = out.numel() * out.element_size()
            acts[0] += size
            acts[3] = max(acts[3], size)
            if isinstance(m, PARAM_LEAVES):
                acts[2] += size
            if isinstance(m, nn.Conv2d):
                unfolded = size // m.out_channels * m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                acts[1] += min(unfolded, num_classes * size)

    handles = [m.register_forward_hook(hook) for m in model.modules() if next(m.children(), None) is None]
    try:
        with torch.no_grad():
            logits = model(x[:2])
            if logits.dim() == 2:
                num_classes = int(logits.shape[-1])
                acts[:] = [0, 0, 0, 0]
                model(x[:2])  # again, now that the number of factors is known
    finally:
        for h in handles:
            h.remove()
    probe = max(1, min(2, int(x.shape[0])))
    extra = acts[1] + (num_classes * (acts[2] + 2 * acts[3]) if batched else 0)
    per_example = max(1, (4 * acts[0] + extra) // probe)
    step = min(int(chunk_size), budget_bytes // per_example)
    if x.device.type == "cpu":
        step = min(step, _CPU_CHUNK_BYTES * probe // max(1, acts[0]))
    return max(1, step)


def exact_diagonal(model: nn.Module, inputs: Tensor, targets: Tensor, loss: Any, *, max_memory_mb: int,
                    chunk_size: int) -> DiagonalResult:
    names: dict[int, tuple[str | None, str | None]] = {}
    covered: set[str] = set()
    param_names = {id(p): n for n, p in model.named_parameters()}
    modules = [m for m in model.modules() if isinstance(m, PARAM_LEAVES)
               and any(p is not None for p in (getattr(m, "weight", None), getattr(m, "bias", None)))]
    for m in modules:
        w = param_names.get(id(m.weight)) if getattr(m, "weight", None) is not None else None
        b = param_names.get(id(m.bias)) if getattr(m, "bias", None) is not None else None
        names[id(m)] = (w, b)
        covered.update(x for x in (w, b) if x is not None)
    missing = [n for n in param_names.values() if n not in covered]
    if missing:
        raise NotExact(f"parameters not owned by a Linear/Conv2d/BatchNorm layer: {missing[:3]}")
    budget = int(max_memory_mb) * 2 ** 20
    diag = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    acc = _Accumulator(names=names, diag=diag, budget_bytes=budget, batched=bool(_BATCHED_BACKWARD))
    step = _chunk_size(model, inputs, acc.batched, chunk_size, budget)
    n = int(inputs.shape[0])
    step = -(-n // max(1, -(-n // step))) if n else step  # equal chunks: 2000 in 2 × 1000, not 1480 + 520
    handles = [m.register_forward_hook(_record_hook(acc)) for m in modules]
    try:
        with GradMode(model):
            for x, y in chunks(inputs, targets, step):
                _exact_chunk(model, x, y, loss, acc)
    finally:
        for h in handles:
            h.remove()
        acc.records = []
    return DiagonalResult(diag={k: v / n for k, v in diag.items()}, method="exact",
                          reason="piecewise linear in every single parameter", n=n)
