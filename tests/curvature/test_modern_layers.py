"""Every curvature measure on the catalogue of modern layers (tests/modern_layers.py) against the dense
Hessian of reverse over reverse, in float64.

The reference of each case is `reference_hessian` (`torch.autograd.functional.hessian`, one backward pass
per row, no vmap, under `math_attention()`) and `torch.linalg.eigvalsh` of it; it is itself checked against
Richardson-extrapolated central differences of the gradient. Through the public API (`flatbench.measure`;
`HessianOperator` for the diagonal):

- exact quantities to `EXACT_RTOL` (1e-10) relative: the trace and per-tensor traces (`hessian_trace`,
  methods exact and auto; the structural paths alone with `exact_max_params: 0`), the diagonal element by
  element (`HessianOperator.diagonal()` on the case's path: piecewise linear, smooth chain or dense; the
  dense path on every case, in chunks, batched and one vector at a time), the top-3 eigenvalues and the
  per-layer / per-block top eigenvalues (Lanczos to a residual of 1e-12 / 1e-11 of the eigenvalue), the
  density's moments (exactly those of the start vectors drawn) and λ_min, λ_max (Krylov space exhausted),
  and, recomputed by brute force from the dense Hessian(s), `matrix_normalized_sharpness` (closed form),
  `normalized_sharpness`(`_nce`) (an independent Newton solver), `minimum_sharpness` (the dense trace of
  the model rescaled by the reported α), `scale_invariant_rangamani` and `relative_flatness`(`_normalized`);
- estimators within `Z` (4) standard errors of the exact value at a fixed seed: Hutch++ and Hutchinson
  (their reported standard errors, total and per tensor), the density's m1 (its reported standard error over
  16 runs) and m2 (it reports none: the exact standard error of the Rademacher quadratic form,
  √(2(‖A‖_F² − Σ A_ii²)/runs)/d with A = H², from the dense Hessian);
- the HVP-based ones (Lanczos top-3, Hutch++, the density's moments) in every mode (auto, rev_fwd,
  fwd_rev): a torch.func mode is used only where its check against double backward passed (the entry's info
  says which), and the numbers are right either way. The exact diagonal paths make no HVPs.

`test_planted_bug_*` shows the λ_max comparison fails on the LayerNorm (and InstanceNorm) cases when
reverse-over-forward is trusted unchecked, so the tests above can fail.
"""

from __future__ import annotations

import importlib
import math
from functools import cache

import pandas as pd
import pytest
import torch
from torch import Tensor, nn

import flatbench
from flatbench.curvature import DENSE_MAX_PARAMS, HessianOperator, exact_applicable, math_attention, modes
from flatbench.curvature.smooth import SMOOTH_REASON
from flatbench.losses import get_loss
from flatbench.seeding import probe_generator

from modern_layers import MODERN_LAYERS, LayerCase, layer_case, reference_hessian

HVP = importlib.import_module("flatbench.curvature.hvp")
MODES = ("auto", "rev_fwd", "fwd_rev")
EXACT_RTOL = 1e-10
"""Relative tolerance of every exact quantity (float64)."""
Z = 4.0
"""Standard errors an estimate may be from the exact value."""
LANCZOS = {"iters": 300, "tol": 1e-12}
"""Lanczos to a residual of 1e-12 × max |θ|: each Ritz value θ is then within that of an eigenvalue."""
HUTCHPP = {"method": "hutchpp", "sketch": 4, "max_sketch": 4, "rtol": 1.0, "max_hvps": 600}
"""Hutch++ with a fixed sketch of 4 (of 48-209 parameters: the rest estimated), stopping at its first check
(30 probes) where the standard error is below the estimate: an estimate to test, cheaply (at rtol 0.5 the
GroupNorm case needed 168 HVPs)."""
DENSITY = {"auto": {"runs": 16, "iters": 2}, "rev_fwd": {"runs": 2, "iters": 2},
           "fwd_rev": {"runs": 2, "iters": 2}}
"""The density's runs and Lanczos steps in each mode. With 2 steps the moments m1, m2 are exact for each start
vector, checked against vᵀHv and vᵀH²v for the start vectors reproduced (in every mode: a sharp check of the
mode's products); auto has 16 start vectors for the statistical check (with 10, the standard error over the
runs was 2.6 times too small on one case; with 16 to 32, every case was within 2.7 standard errors) and gets
its extreme eigenvalues from a second run with as many steps as parameters (`density_extremes`: the Krylov
space exhausted, so they are exact by construction; Lanczos does not depend on the mode, its products are
checked in every mode above and by `test_top_eigenvalues`)."""


@cache
def case(name: str) -> LayerCase:
    """The case, built once per session: never modify its model (`layer_case(name)` gives a fresh one)."""
    return layer_case(name)


@cache
def reference(name: str) -> tuple[Tensor, Tensor]:
    """(H, its eigenvalues ascending) of the case's mean loss."""
    h = reference_hessian(case(name))
    return h, torch.linalg.eigvalsh(h)


def _nce(logits: Tensor, targets: Tensor) -> Tensor:
    """flatbench's normalized_ce (τ = 1), written out: CE((f − mean f) / ‖f − mean f‖, y)."""
    centered = logits - logits.mean(-1, keepdim=True)
    normalized = centered / centered.norm(dim=-1, keepdim=True)
    return nn.functional.cross_entropy(normalized, targets, reduction="none")


def _ce(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits, targets, reduction="none")


@cache
def loss_reference(name: str, loss: str) -> Tensor:
    """H of the case's model and data with another loss: 'ce' (`normalized_sharpness` is defined with it) or
    'normalized_ce' (`normalized_sharpness_nce`)."""
    c = case(name)
    if loss == "ce" and c.loss == "ce":
        return reference(name)[0]
    fn = {"ce": _ce, "normalized_ce": _nce}[loss]
    return reference_hessian(LayerCase(c.name, c.model, c.inputs, c.targets, loss, fn, c.exact_path))


def measure(name: str, measures: list[str], mode: str = "auto", **kwargs) -> pd.DataFrame:
    c = case(name)
    return flatbench.measure(c.model, (c.inputs, c.targets), measures, loss=c.loss, hvp_mode=mode, **kwargs)


def _untagged(key: str) -> str:
    """A result key without its `@loss` (a case's own loss tags the keys of the measures that use it)."""
    head, slash, detail = key.partition("/")
    return head.partition("@")[0] + slash + detail


def values(df: pd.DataFrame, measure_name: str) -> dict[str, float]:
    """The measure's values by key (without `@loss`); the measure must be `ok`."""
    rows = df[df.measure == measure_name]
    assert len(rows) and (rows.status == "ok").all(), rows[["key", "status", "reason"]].to_string()
    return {_untagged(k): v for k, v in zip(rows.key, rows.value)}


def entry_info(df: pd.DataFrame, measure_name: str) -> dict:
    """The measure's info (`df.attrs["info"]`, keyed by its entry key)."""
    (found,) = [v for k, v in df.attrs["info"].items() if _untagged(k) == measure_name]
    return found


def rel(got: float, want: float, scale: float = 0.0) -> float:
    """|got − want| / max(|want|, scale)."""
    return abs(got - want) / max(abs(want), scale, 1e-300)


def block(h: Tensor, idx: Tensor) -> Tensor:
    return h[idx][:, idx]


def indices(c: LayerCase, names: list[str]) -> Tensor:
    slices = c.param_slices()
    return torch.cat([torch.arange(slices[n].start, slices[n].stop) for n in names])


# ---------------------------------------------------------------- the reference


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_the_reference_is_the_hessian(name: str) -> None:
    """H v of the reference against central differences of the gradient (Richardson-extrapolated: no
    second-order derivative formula of torch's involved)."""
    c = case(name)
    h, _ = reference(name)
    slices = c.param_slices()
    params = {k: p.detach() for k, p in c.model.named_parameters()}
    buffers = dict(c.model.named_buffers())
    flat = torch.cat([p.reshape(-1) for p in params.values()])

    def grad(at: Tensor) -> Tensor:
        at = at.clone().requires_grad_(True)
        d = {k: at[slices[k]].view_as(p) for k, p in params.items()}
        with math_attention():
            out = c.loss_fn(torch.func.functional_call(c.model, (d, buffers), (c.inputs,)), c.targets).mean()
        return torch.autograd.grad(out, at)[0]

    v = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    central = lambda step: (grad(flat + step * v) - grad(flat - step * v)) / (2 * step)  # noqa: E731
    fd = (4 * central(1e-4) - central(2e-4)) / 3  # Richardson: error O(step⁴)
    assert float((fd - h @ v).norm() / (h @ v).norm()) < 1e-8


# ---------------------------------------------------------------- exact: the diagonal and the trace


def assert_diagonal(got: dict[str, Tensor], c: LayerCase, h: Tensor) -> float:
    """Element by element, relative to max(|H_ii|, 1e-8 · max |H_jj|); returns the largest error."""
    ours = torch.cat([got[k].reshape(-1).double() for k, _ in c.model.named_parameters()])
    ref = h.diagonal()
    err = (ours - ref).abs() / ref.abs().clamp_min(1e-8 * float(ref.abs().max()))
    worst = int(err.argmax())
    assert float(err[worst]) <= EXACT_RTOL, f"element {worst}: relative error {float(err[worst]):.2e}"
    return float(err.max())


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_the_diagonal_is_exact_on_its_path(name: str) -> None:
    """`HessianOperator.diagonal()` takes the case's exact path (piecewise, smooth chain, or dense up to
    DENSE_MAX_PARAMS) and equals diag H element by element; the dense path (batched second backward passes,
    in chunks of 4 examples) does so on every case; a structural `method='exact'` refuses the dense cases
    with the reason."""
    c = case(name)
    h, _ = reference(name)
    op = HessianOperator(c.model, c.inputs, c.targets, get_loss(c.loss), chunk_size=4)
    auto = op.diagonal(dense_max_params=DENSE_MAX_PARAMS)
    assert auto.method == "exact"
    reasons = {"dense": "dense", "smooth": SMOOTH_REASON, "piecewise": "piecewise linear"}
    assert reasons[c.exact_path] in auto.reason
    assert_diagonal(auto.diag, c, h)
    if c.exact_path == "dense":  # the dense path was the one taken
        assert auto.reason.startswith("dense: ")
        with pytest.raises(ValueError, match="exact Hessian diagonal not applicable: .*(not|no |needs)"):
            op.diagonal(method="exact")
    else:
        assert_diagonal(op.diagonal(method="exact").diag, c, h)
        dense = op.dense_diagonal()
        assert dense.method == "exact" and dense.reason == "dense"
        assert_diagonal(dense.diag, c, h)


@pytest.mark.parametrize("name", ["pre_ln_transformer", "mha_fused", "group_norm"])
def test_the_dense_diagonal_one_vector_at_a_time(name: str, monkeypatch) -> None:
    """The dense diagonal's fallback where an operator has no batching rule (one backward pass per unit
    vector instead of `is_grads_batched` blocks) is exact too."""
    c = case(name)
    h, _ = reference(name)
    real = torch.autograd.grad

    def unbatched(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("planted: no batching rule")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", unbatched)
    op = HessianOperator(c.model, c.inputs, c.targets, get_loss(c.loss), chunk_size=4)
    assert_diagonal(op.dense_diagonal().diag, c, h)


class _ScaledBy(nn.Module):
    """Linear → ReLU → h × c → Linear, with c a buffer, or h / c with c a number computed from the input
    alone, or (not a constant) from the activations."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.fc, self.head, self.by = nn.Linear(5, 6), nn.Linear(6, 3), by
        self.register_buffer("scale", torch.tensor(0.7))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc(x))
        if self.by == "buffer":
            return self.head(h * self.scale)
        return self.head(h / (10 + (x if self.by == "input" else h).sum(-1, keepdim=True)))


@pytest.mark.parametrize("by", ["buffer", "input", "activations"])
def test_a_product_with_a_number_of_the_parameters_is_not_piecewise_linear(by: str) -> None:
    """The traced forward of a plain module qualifies it for the piecewise-linear exact diagonal only where
    every product is with a constant: a buffer or a number computed from the input alone is one (the exact
    diagonal then equals the dense Hessian's), a per-example number computed from the activations is not,
    though on the one-example trace it is a one-element tensor like a constant (it was taken for one: the
    diagonal, 'exact', was far off). The ReLU-network check of the path norm reads the same trace."""
    torch.manual_seed(0)
    model = _ScaledBy(by).double().eval()
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(6) % 3
    ok, reason = exact_applicable(model, x[:1])
    assert ok == (by != "activations"), reason
    diag = HessianOperator(model, x, y, get_loss("ce")).diagonal(dense_max_params=DENSE_MAX_PARAMS)
    c = LayerCase(by, model, x, y, "ce", _ce, "piecewise" if ok else "dense")
    assert assert_diagonal(diag.diag, c, reference_hessian(c)) <= EXACT_RTOL
    if not ok:
        assert "calls div" in reason and diag.reason.startswith("dense")
        path = flatbench.measure(model, (x, y), ["path_norm"])
        assert path.status.iloc[0] == "not_applicable" and "div" in path.reason.iloc[0]


@cache
def exact_entries(name: str) -> pd.DataFrame:
    """Every measure whose value is exact (or solved to a stated tolerance) from the Hessian's diagonal
    blocks, in one call; chunks of 4 examples."""
    return measure(name, ["hessian_trace", "matrix_normalized_sharpness", "normalized_sharpness",
                          "normalized_sharpness_nce", "minimum_sharpness", "relative_flatness",
                          "relative_flatness_normalized", "psi_flatness"],
                   chunk_size=4, settings={"hessian_trace": {"method": "exact"}})


def trace_errors(vals: dict[str, float], c: LayerCase, h: Tensor, key: str = "hessian_trace") -> float:
    """The trace and every per-tensor trace against the dense Hessian's diagonal blocks (a block's trace
    relative to max(|its trace|, 1e-8 Σ|H_ii|)); returns the largest relative error."""
    scale = float(h.diagonal().abs().sum())
    worst = rel(vals[key], float(h.trace()))
    assert set(vals) == {key} | {f"{key}/{k}" for k in c.param_slices()}
    for k, s in c.param_slices().items():
        worst = max(worst, rel(vals[f"{key}/{k}"], float(h.diagonal()[s].sum()), 1e-8 * scale))
    return worst


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_hessian_trace_exact(name: str) -> None:
    c = case(name)
    h, _ = reference(name)
    df = exact_entries(name)
    assert trace_errors(values(df, "hessian_trace"), c, h) <= EXACT_RTOL
    info = entry_info(df, "hessian_trace")
    assert info["method"] == "exact"
    assert ("dense" in info["reason"]) == (c.exact_path == "dense")
    auto = measure(name, ["hessian_trace"])  # method auto: the same exact path on a model this small
    assert trace_errors(values(auto, "hessian_trace"), c, h) <= EXACT_RTOL
    structural = measure(name, ["hessian_trace"],
                         settings={"hessian_trace": {"method": "exact", "exact_max_params": 0}})
    if c.exact_path == "dense":
        (status, reason), = structural[["status", "reason"]].itertuples(index=False)
        assert status == "not_applicable" and "exact_max_params (0)" in reason, reason
    else:
        assert trace_errors(values(structural, "hessian_trace"), c, h) <= EXACT_RTOL


# ---------------------------------------------------------------- HVP-based: in every mode


@cache
def hvp_entries(name: str, mode: str) -> pd.DataFrame:
    """The HVP-based measures of one case in one mode: top-3 eigenvalues, Hutch++, the density's moments,
    and in auto Rangamani's scaled λ_max."""
    rangamani = ["scale_invariant_rangamani"] if mode == "auto" else []
    return measure(name, ["hessian_max_eig", "hessian_trace", "hessian_density", *rangamani], mode,
                   settings={"hessian_max_eig": {"k": 3, **LANCZOS},
                             "hessian_trace": HUTCHPP,
                             "hessian_density": {**DENSITY[mode], "grid": 20, "sigma": 0.1},
                             "scale_invariant_rangamani": {"tol": 1e-12, "max_iter": 300}})


def assert_mode_recorded(info: dict, mode: str) -> None:
    """The entry says which mode computed its products: auto is double backward; a torch.func mode is used
    only where its check passed, else double backward with the reason."""
    hvp = info["hvp"]
    if mode == "auto":
        assert hvp["mode"] == modes.AUTO_MODE == "double_backward" and "fallback" not in hvp
        return
    (check,) = hvp["checks"]
    if hvp["mode"] == mode:
        assert check["passed"] and check["relative_difference"] <= check["tolerance"]
    else:
        assert hvp["mode"] == "double_backward" and hvp["asked"] == mode and not check["passed"]
        assert "double backward used" in hvp["fallback"]


def top_eigenvalue_errors(df: pd.DataFrame, evals: Tensor, k: int = 3) -> list[float]:
    """The reported top-k eigenvalues (info["eigenvalues"]; the value is the first) against eigvalsh's, each
    relative to itself."""
    got = entry_info(df, "hessian_max_eig")["eigenvalues"]
    want = evals.flip(0)[:k].tolist()
    return [rel(g, w) for g, w in zip(got, want)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_top_eigenvalues(name: str, mode: str) -> None:
    _, evals = reference(name)
    df = hvp_entries(name, mode)
    value = values(df, "hessian_max_eig")["hessian_max_eig"]
    info = entry_info(df, "hessian_max_eig")
    assert info["converged"] and len(info["eigenvalues"]) == 3 and value == info["eigenvalues"][0]
    assert max(top_eigenvalue_errors(df, evals)) <= EXACT_RTOL
    assert_mode_recorded(info, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_hutchpp_trace(name: str, mode: str) -> None:
    """Hutch++ within Z standard errors of the exact trace, in total and per tensor."""
    c = case(name)
    h, _ = reference(name)
    df = hvp_entries(name, mode)
    vals = values(df, "hessian_trace")
    info = entry_info(df, "hessian_trace")
    assert info["method"] == "hutchpp" and info["converged"]
    floor = EXACT_RTOL * float(h.diagonal().abs().sum())  # rounding (a sketch of every parameter: exact)
    assert (info["stderr"] > 0) == (info["sketch"] < c.size)
    assert abs(vals["hessian_trace"] - float(h.trace())) <= Z * info["stderr"] + floor
    for k, s in c.param_slices().items():
        error = abs(vals[f"hessian_trace/{k}"] - float(h.diagonal()[s].sum()))
        assert error <= Z * info["stderr_per_param"][k] + floor, k
    assert_mode_recorded(info, mode)


@cache
def density_extremes(name: str) -> pd.DataFrame:
    """The density from one start vector with as many Lanczos steps as parameters: the Krylov space is
    exhausted, so its extreme nodes are the extreme eigenvalues."""
    exhausted = {"runs": 1, "iters": case(name).size, "grid": 20, "sigma": 0.1}
    return measure(name, ["hessian_density"], settings={"hessian_density": exhausted})


def start_vectors(runs: int, d: int) -> Tensor:
    """The density's Rademacher start vectors (runs × d, over √d), drawn as `curvature.density.slq` draws
    them from the measure's generator (seed 0, the measure's name, tag 'slq')."""
    gen = probe_generator(0, "hessian_density", "slq")
    signs = [(torch.randint(0, 2, (d,), generator=gen) * 2 - 1).double() for _ in range(runs)]
    return torch.stack(signs) / math.sqrt(d)


def density_errors(moments: pd.DataFrame, h: Tensor, evals: Tensor, extremes: pd.DataFrame | None = None
                   ) -> dict[str, float]:
    """m1 and m2 relative to the averages of vᵀHv and vᵀH²v over the start vectors v (exact, relative to
    max |λ| and max λ²), and in standard errors from Tr H / d and Tr H² / d (m1's reported standard error; m2
    reports none: the exact one of the Rademacher quadratic form, √(2(‖A‖_F² − Σ A_ii²)/runs)/d, A = H²);
    λ_min and λ_max of `extremes` relative to max |λ|."""
    vals = values(moments, "hessian_density")
    info = entry_info(moments, "hessian_density")
    d, runs = h.shape[0], info["runs"]
    v = start_vectors(runs, d)
    hv = v @ h
    h2 = h @ h
    m2_se = math.sqrt(2 * (float((h2 * h2).sum()) - float((h2.diagonal() ** 2).sum())) / runs) / d
    scale = float(evals.abs().max())
    out = {"m1": rel(vals["hessian_density"], float((v * hv).sum(1).mean()), scale),
           "m2": rel(vals["hessian_density/m2"], float((hv * hv).sum(1).mean()), scale ** 2),
           "m1_z": abs(vals["hessian_density"] - float(evals.mean())) / info["stderr"],
           "m2_z": abs(vals["hessian_density/m2"] - float((evals ** 2).mean())) / m2_se}
    if extremes is not None:
        ext = values(extremes, "hessian_density")
        out["lambda_min"] = rel(ext["hessian_density/lambda_min"], float(evals[0]), scale)
        out["lambda_max"] = rel(ext["hessian_density/lambda_max"], float(evals[-1]), scale)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_density(name: str, mode: str) -> None:
    """The moments are exactly those of the start vectors drawn, and (in auto, with 16 of them) within Z
    standard errors of the spectrum's; in auto λ_min and λ_max are the extreme eigenvalues (`DENSITY`)."""
    h, evals = reference(name)
    moments = hvp_entries(name, mode)
    extremes = density_extremes(name) if mode == "auto" else None
    errors = density_errors(moments, h, evals, extremes)
    exact = ["m1", "m2"] + (["lambda_min", "lambda_max"] if extremes is not None else [])
    assert max(errors[k] for k in exact) <= EXACT_RTOL, errors
    if mode == "auto":
        assert errors["m1_z"] <= Z and errors["m2_z"] <= Z, errors
        assert entry_info(extremes, "hessian_density")["hvps"] <= h.shape[0]
        assert_mode_recorded(entry_info(extremes, "hessian_density"), mode)
    assert entry_info(moments, "hessian_density")["hvps"] <= DENSITY[mode]["runs"] * DENSITY[mode]["iters"]
    assert_mode_recorded(entry_info(moments, "hessian_density"), mode)


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_scale_invariant_rangamani(name: str) -> None:
    """λ_max(D^½ H_WW D^½) / (2 + 2 L_S) over the weight matrices (`layers.weight_matrices`: an attention's
    q, k, v row blocks of `in_proj_weight` each their own), D = blockdiag(‖W_l‖_F² I)."""
    from flatbench.measures.layers import weight_matrices

    c = case(name)
    h, _ = reference(name)
    df = hvp_entries(name, "auto")
    value = values(df, "scale_invariant_rangamani")["scale_invariant_rangamani"]
    slices = c.param_slices()
    parts, norms = [], []
    for m in weight_matrices(c.model, c.inputs[:1]):
        start = slices[m.param].start
        p = m.parameter.detach()
        cols = p[0].numel() if p.ndim > 1 else 1
        rows = m.rows if m.rows is not None else slice(0, p.shape[0])
        parts.append(torch.arange(start + rows.start * cols, start + rows.stop * cols))
        norms.append(p[rows].norm().expand(parts[-1].numel()))
    idx = torch.cat(parts)
    sqrt_d = torch.cat(norms)
    scaled = sqrt_d[:, None] * block(h, idx) * sqrt_d[None, :]
    with torch.no_grad():
        loss = float(c.loss_fn(c.model(c.inputs), c.targets).mean())
    want = float(torch.linalg.eigvalsh(scaled)[-1]) / (2 + 2 * loss)
    assert rel(value, want) <= EXACT_RTOL
    assert entry_info(df, "scale_invariant_rangamani")["converged"]


# ---------------------------------------------------------------- per layer and per block


def groups(model: nn.Module, per: str) -> dict[str, list[str]]:
    """Each module's own parameters (per layer) or each top-level child's (per block); a parameter the model
    holds itself is a group of its own."""
    out: dict[str, list[str]] = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            key = (mod_name or p_name) if per == "layer" else (mod_name.split(".")[0] if mod_name else p_name)
            out.setdefault(key, []).append(full)
    return out


@pytest.mark.parametrize("per", ["layer", "block"])
@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_block_top_eigenvalues(name: str, per: str) -> None:
    """The top eigenvalue of each layer's / block's diagonal block of H (Lanczos on its products)."""
    c = case(name)
    h, _ = reference(name)
    expected = groups(c.model, per)
    if per == "block" and expected == groups(c.model, "layer"):
        pytest.skip("the blocks are the layers (a Sequential)")
    df = measure(name, ["hessian_max_eig"],
                 settings={"hessian_max_eig": {"per": per, "iters": 300, "tol": 1e-11}})
    values(df, "hessian_max_eig")
    got = entry_info(df, "hessian_max_eig")[f"per_{per}"]
    assert set(got) == set(expected)
    for group, members in expected.items():
        want = float(torch.linalg.eigvalsh(block(h, indices(c, members)))[-1])
        assert got[group]["converged"] and got[group]["size"] == len(indices(c, members))
        assert rel(got[group]["eigenvalue"], want) <= EXACT_RTOL, group


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_hutchinson_trace(name: str) -> None:
    c = case(name)
    h, _ = reference(name)
    df = measure(name, ["hessian_trace"], chunk_size=4,
                 settings={"hessian_trace": {"method": "hutchinson", "probes": 20}})
    vals = values(df, "hessian_trace")
    info = entry_info(df, "hessian_trace")
    assert info["method"] == "hutchinson" and info["probes"] == 20
    assert abs(vals["hessian_trace"] - float(h.trace())) <= Z * info["stderr"]
    for k, s in c.param_slices().items():
        error = abs(vals[f"hessian_trace/{k}"] - float(h.diagonal()[s].sum()))
        assert error <= Z * info["stderr_per_param"][k] + 1e-12, k


# ---------------------------------------------------------------- the normalized measures, by brute force


def reduced(h_diag: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(H, W²) as out × in matrices: negative diagonal entries clamped to 0 (the measures' rule), conv
    kernels summed over their spatial axes."""
    hd, q = h_diag.clamp_min(0).view_as(weight).double(), weight.detach().double() ** 2
    if hd.dim() > 2:
        hd, q = hd.flatten(2).sum(2), q.flatten(2).sum(2)
    return hd, q


def normalized_sharpness_brute(hd: Tensor, q: Tensor) -> float:
    """min_{σ, σ' > 0} Σ_ij H_ij σ_i σ'_j + Q_ij / (σ_i σ'_j), by Newton's method on (log σ, log σ') with the
    last log σ' fixed at 0 (the flat direction), after dropping rows and columns whose H or Q is zero (their
    terms' infimum is 0; until none is: dropping a row can empty a column), to the float64 floor."""
    while hd.numel():
        rows, cols = (hd.sum(1) > 0) & (q.sum(1) > 0), (hd.sum(0) > 0) & (q.sum(0) > 0)
        if rows.all() and cols.all():
            break
        hd, q = hd[rows][:, cols], q[rows][:, cols]
    if not hd.numel():
        return 0.0
    m, n = hd.shape
    x = torch.zeros(m + n - 1, dtype=torch.float64)

    def parts(x: Tensor) -> tuple[Tensor, Tensor]:
        e = torch.exp(x[:m, None] + torch.cat([x[m:], torch.zeros(1, dtype=torch.float64)])[None, :])
        return hd * e, q / e

    def f(x: Tensor) -> float:
        a, b = parts(x)
        return float((a + b).sum())

    for _ in range(200):
        a, b = parts(x)
        g, p = a - b, a + b
        grad = torch.cat([g.sum(1), g.sum(0)[:-1]])
        hess = torch.zeros(m + n - 1, m + n - 1, dtype=torch.float64)
        hess[:m, :m] = torch.diag(p.sum(1))
        hess[m:, m:] = torch.diag(p.sum(0)[:-1])
        hess[:m, m:] = p[:, :-1]
        hess[m:, :m] = p[:, :-1].t()
        step = -torch.linalg.solve(hess, grad)
        t, value = 1.0, f(x)
        while f(x + t * step) > value and t > 1e-12:
            t /= 2
        x = x + t * step
        if float(-(grad @ step)) <= 1e-30 * value:
            break
    return f(x)


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_normalized_sharpness_measures(name: str) -> None:
    """matrix_normalized_sharpness (closed form 2‖W‖_F √Tr H_W) and normalized_sharpness(_nce) (the convex
    problem, solved to KKT residual 1e-10: the value to far better than 1e-10) per weight matrix
    (`layers.weight_matrices`: an attention's q, k, v row blocks each their own), from the dense Hessians'
    diagonals (of the case's loss, of ce, of normalized_ce)."""
    from flatbench.measures.layers import weight_matrices

    c = case(name)
    h, _ = reference(name)
    df = exact_entries(name)
    matrices = weight_matrices(c.model, c.inputs[:1])
    params = dict(c.model.named_parameters())
    slices = c.param_slices()
    for key, hess in (("matrix_normalized_sharpness", h),
                      ("normalized_sharpness", loss_reference(name, "ce")),
                      ("normalized_sharpness_nce", loss_reference(name, "normalized_ce"))):
        vals = values(df, key)
        assert set(vals) == {key} | {f"{key}/{m.name}" for m in matrices}
        total = 0.0
        for m in matrices:
            n = m.name
            p = params[m.param]
            rows = m.rows if m.rows is not None else slice(0, p.shape[0])
            diag = hess.diagonal()[slices[m.param]].view_as(p)[rows]
            hd, q = reduced(diag.reshape(-1), p[rows])
            if key == "matrix_normalized_sharpness":
                want = 2 * math.sqrt(float(q.sum())) * math.sqrt(float(hd.sum()))
            else:
                want = normalized_sharpness_brute(hd, q)
                assert 2 * float((hd * q).sqrt().sum()) * (1 - 1e-12) <= vals[f"{key}/{n}"]
                assert vals[f"{key}/{n}"] <= 2 * math.sqrt(float(q.sum()) * float(hd.sum())) * (1 + 1e-12)
            assert rel(vals[f"{key}/{n}"], want) <= EXACT_RTOL, (key, n)
            total += want
        assert rel(vals[key], total) <= EXACT_RTOL
        if key != "matrix_normalized_sharpness":
            assert entry_info(df, key)["converged"]


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_minimum_sharpness(name: str) -> None:
    """Where it applies (a Sequential ReLU chain without normalization), the minimum over layer-wise
    rescalings of Tr H: the dense trace of the model rescaled by the reported α equals the value, and no
    rescaling near it is lower; elsewhere not applicable, with the reason."""
    c = case(name)
    df = exact_entries(name)
    row = df[df.measure == "minimum_sharpness"].iloc[0]
    if c.name != "relu_mlp_smoothed":
        assert row.status == "not_applicable"
        assert any(word in row.reason for word in ("rescaling is not defined", "not a weight layer's output",
                                                    "BatchNorm")), row.reason
        return
    value = values(df, "minimum_sharpness")["minimum_sharpness"]
    alpha = entry_info(df, "minimum_sharpness")["alpha"]

    def rescaled_trace(factors: list[float]) -> float:
        model = layer_case(name).model
        linears = [m for m in model if isinstance(m, nn.Linear)]
        prod = 1.0
        with torch.no_grad():
            for m, a in zip(linears[:-1], factors):
                prod *= a
                m.weight.mul_(a)
                m.bias.mul_(prod)
            linears[-1].weight.div_(prod)
        return float(reference_hessian(LayerCase(name, model, c.inputs, c.targets, c.loss, c.loss_fn,
                                                 c.exact_path)).trace())

    best = [alpha["0"], alpha["2"]]
    assert rel(rescaled_trace(best), value) <= EXACT_RTOL
    assert rescaled_trace([1.0, 1.0]) > value  # the trained scale is not the minimum
    for i in range(2):
        for f in (0.99, 1.01):
            nudged = list(best)
            nudged[i] *= f
            assert rescaled_trace(nudged) > value


def relative_flatness_brute(c: LayerCase, h: Tensor, normalize: bool) -> float:
    """Σ_{s,s'} ⟨w_s, w_s'⟩ Tr H_{s,s'} over the head's weight block of the dense Hessian; normalized: each
    feature unit j scaled to unit RMS r_j over the examples (W̃ = W r, H̃ = H / (r_j r_k))."""
    weight = c.model.head.weight if hasattr(c.model, "head") else c.model[-1].weight
    name = "head.weight" if hasattr(c.model, "head") else f"{len(c.model) - 1}.weight"
    out_n, in_n = weight.shape
    hw = block(h, indices(c, [name])).view(out_n, in_n, out_n, in_n)
    w = weight.detach().double()
    tr = torch.einsum("sjtj->stj", hw)  # Tr H_{s,s'} before summing over the feature j
    if not normalize:
        return float(((w @ w.t()) * tr.sum(-1)).sum())
    feats = []
    layer = c.model.head if hasattr(c.model, "head") else c.model[-1]
    hook = layer.register_forward_hook(lambda m, a, o: feats.append(a[0]))
    with torch.no_grad():
        c.model(c.inputs)
    hook.remove()
    r2 = feats[0].pow(2).mean(0)
    return float(torch.einsum("sj,tj,j,stk,k->", w, w, r2, tr, 1 / r2))


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_relative_flatness(name: str) -> None:
    c = case(name)
    h, _ = reference(name)
    df = exact_entries(name)
    for key, normalize in (("relative_flatness", False), ("relative_flatness_normalized", True)):
        assert rel(values(df, key)[key], relative_flatness_brute(c, h, normalize)) <= EXACT_RTOL, key


@pytest.mark.parametrize("name", MODERN_LAYERS)
def test_psi_flatness_does_not_apply(name: str) -> None:
    row = exact_entries(name).query("measure == 'psi_flatness'").iloc[0]
    assert row.status == "not_applicable" and ("bias" in row.reason or "ReLU" in row.reason), row.reason


# ---------------------------------------------------------------- planted bugs


@pytest.mark.parametrize("name", ["pre_ln_transformer", "post_ln_transformer", "attention_math",
                                  "instance_norm_1d", "instance_norm_2d"])
def test_planted_bug_trusting_rev_fwd_breaks_the_top_eigenvalues(name: str, monkeypatch) -> None:
    """With rev_fwd's check made to pass, reverse-over-forward computes the top eigenvalues through LayerNorm
    / InstanceNorm and `test_top_eigenvalues`' comparison is far off (the nn.MultiheadAttention and
    nn.TransformerEncoderLayer fast paths have no forward-mode derivative at all, so there the entry is an
    error unless the fast path is turned off)."""
    _, evals = reference(name)
    monkeypatch.setattr(HVP, "check_mode", lambda *a, **k: modes.ModeCheck("rev_fwd", True, 0.0, 1e-8))
    settings = {"hessian_max_eig": {"k": 3, **LANCZOS}}
    if "transformer" in name:
        df = measure(name, ["hessian_max_eig"], "rev_fwd", settings=settings)
        assert df.status.iloc[0] == "error" and "forward AD" in df.reason.iloc[0]
        monkeypatch.setattr(torch.backends.mha, "get_fastpath_enabled", lambda: False)
    df = measure(name, ["hessian_max_eig"], "rev_fwd", settings=settings)
    assert entry_info(df, "hessian_max_eig")["hvp"]["mode"] == "rev_fwd"
    errors = top_eigenvalue_errors(df, evals)
    assert max(errors) > 1e-3
