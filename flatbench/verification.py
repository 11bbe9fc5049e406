"""`flatbench verify`: check a model's curvature against its dense Hessian, on the model a user brings.

flatbench's curvature measures are tested against dense Hessians on a catalogue of layers
(tests/modern_layers.py), but a user's architecture may hold an operator that catalogue lacks, and in torch
2.14.1 one derivative mode (reverse over forward) is silently wrong through LayerNorm and InstanceNorm. So a
user can ask, for their own model and data:

    flatbench.verify(model, (x, y))                       # a DataFrame, one row per check
    flatbench verify my_model.py:build --data my.npz --checkpoint model.pt

**What is compared.** A model of a few hundred parameters is taken whole. A larger one is cut to a *slice*:
`max_params` of its parameters, drawn (seeded) from every parameter tensor, the others held fixed; the
Hessian of the loss in the slice is the diagonal block H_SS of the full Hessian, and `SlicedModel` is the
model as a function of the slice alone, with the same operators in its forward pass. The reference is H_SS
in float64 by reverse over reverse (`torch.autograd.functional.hessian`, one backward pass per slice entry,
attention in its math form), itself checked against central finite differences of the gradient along
random directions. Then:

* the Hessian-vector product of the whole model, in each derivative mode as torch computes it (information:
  a mode that is wrong here is named, and flatbench's check replaces it), and as flatbench computes it in the
  mode asked for (checked: must agree);
* the Hessian diagonal flatbench's measures share (exact structural or dense paths), at the slice;
* on the slice (or the whole small model), the measures themselves: `hessian_trace` exact and by Hutch++,
  `hessian_max_eig` with its top three eigenvalues, `hessian_density`'s mean eigenvalue and extreme
  eigenvalues, each against the dense Hessian (exact quantities to `EXACT_RTOL`, estimates within
  `STDERRS` of their reported standard errors).

Everything runs in float64 on a copy of the model, in eval mode; the caller's model is left as it came.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn
from torch.func import functional_call

from flatbench.api import as_tensors, measure_records
from flatbench.curvature import HessianOperator, math_attention
from flatbench.curvature.hvp import product_in_mode, hvp
from flatbench.curvature.modes import CHECKED_MODES, HVP_MODES, REFERENCE_MODE, hvp_log, use_hvp_mode
from flatbench.curvature.operator import DENSE_MAX_PARAMS
from flatbench.errors import FlatbenchError
from flatbench.losses import get_loss
from flatbench.measures.arguments import copy_model, trial_forward

EXACT_RTOL = 1e-8
"""Exact quantities (products, diagonals, traces) against the dense Hessian: both are float64 sums of the
same terms in other orders, so they agree to rounding (1e-12 on the catalogue); 1e-8 leaves room for ill-
conditioned models and still catches any wrong formula (those differ by 1e-3 and more)."""
EIGEN_RTOL = 1e-6
"""Lanczos eigenvalues (stopped at a residual of 1e-10 relative) against `eigvalsh`."""
STDERRS = 4.0
"""An estimate passes within this many of its reported standard errors."""
FD_RTOL = 1e-4
"""The reference against central finite differences of the gradient (step ~1e-5: truncation ~1e-10,
rounding ~1e-11; a kink of ReLU or max-pooling crossed by the step can spoil one direction)."""
DEFAULT_PARAMS = 200
DEFAULT_EXAMPLES = 32
COLUMNS = ("check", "flatbench", "reference", "rel_error", "tolerance", "verdict", "note")


class SlicedModel(nn.Module):
    """`model` as a function of some of its parameter entries (`selection`: parameter name → flat indices),
    the others fixed at their values: its one parameter `theta` holds the selected entries, and its forward
    puts them into the full parameters (`index_put`) and calls the model functionally, so its Hessian is the
    diagonal block of the model's Hessian at those entries and its forward runs the model's operators."""

    def __init__(self, model: nn.Module, selection: dict[str, Tensor]):
        super().__init__()
        self.inner = [model]  # a list: not a submodule, so `theta` is the only parameter
        self.selection = selection
        params = dict(model.named_parameters())
        self.fixed = {k: p.detach().clone() for k, p in params.items()}
        self.buffers_of = dict(model.named_buffers())
        self.theta = nn.Parameter(torch.cat([params[k].detach().reshape(-1)[idx] for k, idx in selection.items()]))

    def full_parameters(self, theta: Tensor) -> dict[str, Tensor]:
        out = dict(self.fixed)
        offset = 0
        for name, idx in self.selection.items():
            part = theta[offset:offset + idx.numel()]
            offset += idx.numel()
            flat = self.fixed[name].reshape(-1).index_put((idx,), part)
            out[name] = flat.view_as(self.fixed[name])
        return out

    def forward(self, x: Tensor) -> Tensor:
        return functional_call(self.inner[0], (self.full_parameters(self.theta), self.buffers_of), (x,))


def choose_slice(model: nn.Module, max_params: int, generator: torch.Generator) -> dict[str, Tensor]:
    """Flat indices of at most `max_params` parameter entries: every entry of a model that small; else a
    seeded draw from every parameter tensor (each gets a share by its size, at least one entry while the
    budget lasts, tensors taken in turn from the largest)."""
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if total <= max_params:
        return {k: torch.arange(p.numel()) for k, p in params.items()}
    sizes = {k: p.numel() for k, p in params.items()}
    order = sorted(sizes, key=lambda k: -sizes[k])
    share = {k: 0 for k in sizes}
    budget = max_params
    for k in order:  # one each first, largest tensors first, so every tensor is seen while the budget allows
        if budget == 0:
            break
        share[k], budget = 1, budget - 1
    rest = sum(sizes[k] - share[k] for k in order if share[k])
    for k in order:
        if share[k] and rest > 0:
            extra = min(sizes[k] - share[k], int(budget * (sizes[k] - share[k]) / rest))
            share[k] += extra
    left = max_params - sum(share.values())
    for k in order:  # what rounding left over, to the largest tensors
        if left <= 0:
            break
        add = min(left, sizes[k] - share[k])
        share[k] += add
        left -= add
    out = {}
    for k in params:
        if share[k]:
            out[k] = torch.sort(torch.randperm(sizes[k], generator=generator)[:share[k]]).values
    return out


def reference_hessian(net: nn.Module, x: Tensor, y: Tensor, loss: Callable) -> Tensor:
    """∇²_θ L of the mean loss by reverse over reverse, one backward pass per parameter (no vmap)."""
    params = {k: p.detach() for k, p in net.named_parameters()}
    buffers = dict(net.named_buffers())
    flat = torch.cat([p.reshape(-1) for p in params.values()])

    def f(theta: Tensor) -> Tensor:
        d, offset = {}, 0
        for k, p in params.items():
            d[k] = theta[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return loss(functional_call(net, (d, buffers), (x,)), y)

    with math_attention():
        h = torch.autograd.functional.hessian(f, flat)
    return 0.5 * (h + h.T)


def _gradient(net: nn.Module, x: Tensor, y: Tensor, loss: Callable, theta: Tensor) -> Tensor:
    params = {k: p.detach() for k, p in net.named_parameters()}
    buffers = dict(net.named_buffers())
    leaf = theta.detach().requires_grad_(True)
    d, offset = {}, 0
    for k, p in params.items():
        d[k] = leaf[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    with torch.enable_grad(), math_attention():
        (g,) = torch.autograd.grad(loss(functional_call(net, (d, buffers), (x,)), y), leaf)
    return g


def finite_difference_error(net: nn.Module, x: Tensor, y: Tensor, loss: Callable, h: Tensor,
                            generator: torch.Generator, directions: int = 3) -> float:
    """The largest relative difference between H v and the central difference of the gradient along v,
    over a few random unit directions v (each tried with two step sizes; the better kept)."""
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    scale = 1.0 + float(theta.abs().mean())
    worst = 0.0
    for _ in range(directions):
        v = torch.randn(theta.numel(), generator=generator, dtype=theta.dtype)
        v = v / v.norm()
        exact = h @ v
        best = math.inf
        for step in (1e-5 * scale, 1e-6 * scale):
            fd = (_gradient(net, x, y, loss, theta + step * v) - _gradient(net, x, y, loss, theta - step * v)) / (2 * step)
            best = min(best, float((fd - exact).norm() / max(float(exact.norm()), 1e-300)))
        worst = max(worst, best)
    return worst


@dataclass
class Row:
    check: str
    flatbench: float
    reference: float
    rel_error: float
    tolerance: float
    verdict: str
    """ok | FAIL | wrong (a raw derivative mode flatbench does not use unchecked) | info."""
    note: str = ""


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def _exact(check: str, got: float, ref: float, tol: float = EXACT_RTOL, note: str = "") -> Row:
    rel = _rel(got, ref)
    return Row(check, got, ref, rel, tol, "ok" if rel <= tol else "FAIL", note)


def _estimate(check: str, got: float, ref: float, stderr: float | None, note: str = "") -> Row:
    se = float(stderr) if stderr is not None and math.isfinite(float(stderr)) else 0.0
    allowed = STDERRS * se
    ok = abs(got - ref) <= max(allowed, EXACT_RTOL * max(abs(ref), 1e-300))
    text = f"standard error {se:.3g}; |error| = {abs(got - ref) / se:.2f} standard errors" if se > 0 else "no spread"
    return Row(check, got, ref, _rel(got, ref), allowed / max(abs(ref), 1e-300), "ok" if ok else "FAIL",
               "; ".join(t for t in (text, note) if t))


def verify(model: nn.Module, data: Any, *, loss: str | Callable = "ce", n_examples: int | None = None,
           batch_fn: Callable[[Any], Any] | None = None,
           max_params: int = DEFAULT_PARAMS, seed: int = 0, hvp_mode: str = "auto", chunk_size: int = 2000) -> Any:
    """Check flatbench's curvature on `model` and `data` against the dense Hessian (see the module doc).

    `data`: an (inputs, targets) pair or a DataLoader (dict batches with `batch_fn`, as `measure` takes
    them), of which the first `n_examples` are used (default: the first `DEFAULT_EXAMPLES`, or all of fewer;
    a number above the data is refused) (the dense Hessian costs one backward pass per slice
    entry over them). `max_params`: the slice's size (a model this
    small is taken whole). `hvp_mode`: the mode to verify as flatbench uses it. Returns a DataFrame with one row
    per check (`COLUMNS`); `df.attrs["failed"]` counts the checks of flatbench's own results that failed, and
    `df.attrs["slice"]` says what was compared."""
    if not isinstance(model, nn.Module):
        raise FlatbenchError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if hvp_mode not in HVP_MODES:
        raise FlatbenchError(f"hvp_mode must be one of {', '.join(HVP_MODES)}, got {hvp_mode!r}")
    if isinstance(max_params, bool) or not isinstance(max_params, int) or max_params < 1:
        raise FlatbenchError(f"max_params must be a positive integer, got {max_params!r}")
    x, y = as_tensors(data, DEFAULT_EXAMPLES if n_examples is None else n_examples, batch_fn,
                      at_most=n_examples is None)
    x = x.double() if x.is_floating_point() else x
    loss_fn = get_loss(loss)
    net = copy_model(model).double().eval()
    for p in net.parameters():
        p.requires_grad_(True)
    trial_forward(net, x, y, loss_fn)
    gen = torch.Generator().manual_seed(seed)
    selection = choose_slice(net, max_params, gen)
    total = sum(p.numel() for p in net.parameters())
    whole = sum(i.numel() for i in selection.values()) == total
    target = net if whole else SlicedModel(net, selection)
    size = sum(p.numel() for p in target.parameters())
    h = reference_hessian(target, x, y, loss_fn)
    eig = torch.linalg.eigvalsh(h)
    rows: list[Row] = []
    fd = finite_difference_error(target, x, y, loss_fn, h, gen)
    rows.append(Row("reference: dense Hessian vs finite differences of the gradient", fd, 0.0, fd, FD_RTOL,
                    "ok" if fd <= FD_RTOL else "FAIL",
                    "" if fd <= FD_RTOL else "the reference itself disagrees (a kink crossed, or double backward "
                                             "is wrong here): no check below can be trusted"))
    rows += _product_rows(net, x, y, loss_fn, selection, h, gen, hvp_mode, chunk_size)
    rows += _diagonal_rows(net, x, y, loss_fn, selection, h, chunk_size)
    rows += _measure_rows(target, x, y, loss, h, eig, hvp_mode, seed, chunk_size)
    df = pd.DataFrame([(r.check, r.flatbench, r.reference, r.rel_error, r.tolerance, r.verdict, r.note)
                       for r in rows], columns=list(COLUMNS))
    df.attrs["failed"] = int((df["verdict"] == "FAIL").sum())
    df.attrs["slice"] = (f"all {total} parameters" if whole else
                         f"{size} of {total} parameters, from {len(selection)} of "
                         f"{len(dict(net.named_parameters()))} tensors (seed {seed})") + f", {x.shape[0]} examples"
    return df


def _product_rows(net: nn.Module, x: Tensor, y: Tensor, loss: Callable, selection: dict[str, Tensor], h: Tensor,
                  gen: torch.Generator, hvp_mode: str, chunk_size: int) -> list[Row]:
    """The full model's product with a vector supported on the slice, read on the slice: each raw mode, then
    flatbench's (checked) product in `hvp_mode`."""
    params = {k: p.detach() for k, p in net.named_parameters()}
    v_slice = torch.randn(h.shape[0], generator=gen, dtype=torch.float64)
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    offset = 0
    for k, idx in selection.items():
        v[k].view(-1)[idx] = v_slice[offset:offset + idx.numel()]
        offset += idx.numel()
    expected = h @ v_slice

    def on_slice(hv: dict[str, Tensor]) -> Tensor:
        return torch.cat([hv[k].reshape(-1)[idx] for k, idx in selection.items()])

    def rel(got: Tensor) -> float:
        return float((got - expected).norm() / max(float(expected.norm()), 1e-300))

    rows = []
    with math_attention():
        for mode in (REFERENCE_MODE, *CHECKED_MODES):
            try:
                err = rel(on_slice(product_in_mode(net, x, y, loss, v, chunk_size, mode)))
            except (NotImplementedError, RuntimeError) as exc:
                rows.append(Row(f"HVP, {mode} as torch computes it", math.nan, math.nan, math.nan, EXACT_RTOL,
                                "info", f"fails: {str(exc).splitlines()[0][:120]}"))
                continue
            verdict = "ok" if err <= EXACT_RTOL else ("FAIL" if mode == REFERENCE_MODE else "wrong")
            note = "" if verdict != "wrong" else (f"wrong on this model in this torch; flatbench checks {mode} "
                                                 "before using it and uses double backward instead")
            rows.append(Row(f"HVP, {mode} as torch computes it", err, 0.0, err, EXACT_RTOL, verdict, note))
    model = net
    use_hvp_mode(model, hvp_mode)
    with hvp_log() as log:
        err = rel(on_slice(hvp(model, x, y, loss, v, chunk_size=chunk_size)))
    info = log.info()
    note = f"computed by {info['mode']}" + (f" ({info['fallback']})" if "fallback" in info else "")
    rows.append(Row(f"HVP as flatbench computes it (hvp_mode {hvp_mode})", err, 0.0, err, EXACT_RTOL,
                    "ok" if err <= EXACT_RTOL else "FAIL", note))
    return rows


def _diagonal_rows(net: nn.Module, x: Tensor, y: Tensor, loss: Callable, selection: dict[str, Tensor],
                   h: Tensor, chunk_size: int) -> list[Row]:
    """The Hessian diagonal the measures share (`HessianOperator.diagonal`), at the slice, where it is exact."""
    op = HessianOperator(net, x, y, loss, chunk_size=chunk_size)
    applies, why = op.exact_diagonal_applies()
    if not applies and op.size > DENSE_MAX_PARAMS:
        return [Row("Hessian diagonal (shared by the measures)", math.nan, math.nan, math.nan, EXACT_RTOL, "info",
                    f"estimated by Hutchinson on this model ({why}); the measures' estimates are checked on the "
                    "slice below")]
    result = op.diagonal(dense_max_params=DENSE_MAX_PARAMS)
    got = torch.cat([result.diag[k].reshape(-1)[idx].double() for k, idx in selection.items()])
    ref = torch.diagonal(h)
    err = float((got - ref).norm() / max(float(ref.norm()), 1e-300))
    return [Row("Hessian diagonal (shared by the measures)", err, 0.0, err, EXACT_RTOL,
                "ok" if err <= EXACT_RTOL else "FAIL", f"{result.method}: {result.reason}"[:160])]


def _measure_rows(target: nn.Module, x: Tensor, y: Tensor, loss: Any, h: Tensor, eig: Tensor, hvp_mode: str,
                  seed: int, chunk_size: int) -> list[Row]:
    """The curvature measures on the target (the model, or its slice) against the dense Hessian."""
    size = h.shape[0]
    k = min(3, size)
    iters = min(size, 300)
    settings = {"hessian_max_eig": {"k": k, "iters": iters, "tol": 1e-10},
                "hessian_density": {"runs": 10, "iters": min(size, 100)}}
    records = measure_records(target, (x, y), ["hessian_trace", "hessian_max_eig", "hessian_density"], loss=loss,
                              settings=settings, seed=seed, hvp_mode=hvp_mode, chunk_size=chunk_size,
                              n_examples=None)
    hutchpp = measure_records(target, (x, y), ["hessian_trace"], loss=loss, seed=seed, hvp_mode=hvp_mode,
                              settings={"hessian_trace": {"method": "hutchpp"}}, chunk_size=chunk_size)
    rows: list[Row] = []
    where = "on the model" if not isinstance(target, SlicedModel) else "on the slice"

    def entry(recs: dict[str, Any], name: str) -> dict[str, Any] | None:
        record = next((r for r in recs.values() if r["measure"] == name), None)
        if record is None or record["status"] not in ("ok", "not_converged"):
            reason = (record or {}).get("reason") or (record or {}).get("error") or "missing"
            rows.append(Row(f"{name} {where}", math.nan, math.nan, math.nan, math.nan, "FAIL", str(reason)[:160]))
            return None
        return record

    trace = float(torch.trace(h))
    rec = entry(records, "hessian_trace")
    if rec is not None:
        rows.append(_exact(f"hessian_trace {where}", _headline(rec, "hessian_trace"), trace,
                           note=str(rec["info"].get("method", ""))))
    rec = entry(hutchpp, "hessian_trace")
    if rec is not None:
        rows.append(_estimate(f"hessian_trace {where}, Hutch++", _headline(rec, "hessian_trace"), trace,
                              rec["info"].get("stderr"), _hvp_note(rec)))
    rec = entry(records, "hessian_max_eig")
    if rec is not None:
        top = sorted((float(e) for e in eig), reverse=True)[:k]
        for i, (got, ref) in enumerate(zip(rec["info"]["eigenvalues"], top)):
            rows.append(_exact(f"hessian_max_eig {where}, eigenvalue {i + 1}", float(got), ref, EIGEN_RTOL,
                               _hvp_note(rec) if i == 0 else ""))
    rec = entry(records, "hessian_density")
    if rec is not None:
        rows.append(_estimate(f"hessian_density {where}, mean eigenvalue", _headline(rec, "hessian_density"),
                              trace / size, rec["info"].get("stderr"), _hvp_note(rec)))
        exhausted = min(size, 100) >= size
        for key, ref in (("lambda_max", float(eig[-1])), ("lambda_min", float(eig[0]))):
            got = _headline(rec, f"hessian_density/{key}")
            if exhausted:
                rows.append(_exact(f"hessian_density {where}, {key}", got, ref, EIGEN_RTOL))
            else:
                inside = float(eig[0]) - 1e-9 * abs(float(eig[0])) <= got <= float(eig[-1]) + 1e-9 * abs(float(eig[-1]))
                rows.append(Row(f"hessian_density {where}, {key}", got, ref, _rel(got, ref), math.nan,
                                "ok" if inside else "FAIL", "a Ritz value: inside the spectrum, not yet extreme"))
    return rows


def _headline(record: dict[str, Any], key: str) -> float:
    values = record.get("values") or record["info"].get("values") or {}
    return float(next(v for k, v in values.items() if k == key or k.startswith(key + "@")))


def _hvp_note(record: dict[str, Any]) -> str:
    info = record.get("info", {}).get("hvp")
    if not info:
        return ""
    return f"HVPs by {info['mode']}" + (f" ({info['fallback']})" if "fallback" in info else "")


def format_table(df: Any) -> list[str]:
    """The checks as aligned text lines, then a verdict line."""
    def num(v: float) -> str:
        return "-" if not isinstance(v, float) or not math.isfinite(v) else f"{v:.6g}"

    table = [("check", "flatbench", "reference", "rel. error", "tolerance", "verdict")]
    table += [(r.check, num(r.flatbench), num(r.reference), num(r.rel_error), num(r.tolerance),
               r.verdict + (f"  {r.note}" if r.note else "")) for r in df.itertuples()]
    widths = [max(len(row[c]) for row in table) for c in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in table]
    failed = df.attrs.get("failed", 0)
    lines.append("")
    lines.append(f"compared: {df.attrs.get('slice', '')}")
    lines.append(f"FAILED: {failed} check(s) of flatbench's curvature disagree with the dense Hessian" if failed
                 else "passed: flatbench's curvature agrees with the dense Hessian on this model")
    return lines
