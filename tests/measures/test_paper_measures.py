"""The three papers' measures: solvers against closed forms and generic optimizers, bounds, basis paths."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from cases import case, solver_problem
from scipy.optimize import minimize
from torch import nn

from flatbench import rescale
from flatbench.curvature import hessian_diagonal
from flatbench.losses import get_loss
from flatbench.measures import NotApplicable, all_measures
from flatbench.measures.context import MeasureContext
from flatbench.measures.builtin.minimum_sharpness import solve_minimum_sharpness
from flatbench.measures.builtin.normalized import (
    lower_bound,
    matrix_normalized,
    reduce_layer,
    solve_normalized_sharpness,
)
from flatbench.measures.builtin.psi import basis_paths, rebuild
from flatbench.models import MLP

# ---------------------------------------------------------------- helpers


def _ns_objective(h: np.ndarray, q: np.ndarray):
    """f(log σ, log σ') and its gradient, for scipy."""
    out_n = h.shape[0]

    def fun(z: np.ndarray) -> tuple[float, np.ndarray]:
        u, v = z[:out_n], z[out_n:]
        e = np.exp(u[:, None] + v[None, :])
        a, b = h * e, q / e
        grad_m = a - b
        return float(a.sum() + b.sum()), np.concatenate([grad_m.sum(1), grad_m.sum(0)])

    return fun


def _data(n: int, shape: tuple[int, ...], classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x, y


def _run(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str = "ce"):
    spec = all_measures()[name]
    ctx = MeasureContext(model=model, inputs=x, targets=y, num_classes=int(y.max()) + 1)
    return spec.fn(ctx.for_measure(name, dict(spec.defaults), loss_name=loss))


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    c = case(name)
    return c.model, c.inputs, c.targets


@pytest.fixture(scope="module")
def tiny_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The catalogue's MLP with biases (hidden layers '1', '3', output '5')."""
    return _case("mlp")


@pytest.fixture(scope="module")
def tiny_mlp_nobias() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return _case("mlp_nobias")


@pytest.fixture(scope="module")
def psi_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The catalogue's bias-free MLP with equal hidden widths (the psi measures' domain)."""
    return _case("mlp_psi")


# ---------------------------------------------------------------- normalized sharpness: the solver


@pytest.mark.parametrize("shape,seed", [((5, 7), 0), ((30, 12), 1), ((16, 6), 2), ((1, 9), 3), ((8, 1), 4)])
def test_alternating_solver_matches_generic_optimizer(shape: tuple[int, int], seed: int) -> None:
    h, q = solver_problem(*shape, seed)
    res = solve_normalized_sharpness(h, q)
    assert res.converged and res.rel_change <= 1e-10 and res.kkt_residual <= 1e-10
    fun = _ns_objective(h.numpy(), q.numpy())
    z0 = np.zeros(sum(shape))
    ref = minimize(fun, z0, jac=True, method="L-BFGS-B",
                   options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-12})
    assert res.value <= ref.fun * (1 + 1e-9)
    assert res.value == pytest.approx(ref.fun, rel=1e-7)
    # the reported variances attain the value
    value_at = float(res.sigma @ h @ res.sigma_prime + (1 / res.sigma) @ q @ (1 / res.sigma_prime))
    assert value_at == pytest.approx(res.value, rel=1e-12)


def test_solver_rank_one_closed_form() -> None:
    """H = a bᵀ, W² = c dᵀ: by Cauchy–Schwarz NS = 2 (Σ sqrt(a_i c_i)) (Σ sqrt(b_j d_j))."""
    gen = torch.Generator().manual_seed(0)
    a, c = (torch.rand(9, generator=gen, dtype=torch.float64) + t for t in (0.1, 0.0))
    b, d = (torch.rand(14, generator=gen, dtype=torch.float64) + t for t in (0.1, 0.0))
    res = solve_normalized_sharpness(torch.outer(a, b), torch.outer(c, d))
    expected = 2 * float((a * c).sqrt().sum()) * float((b * d).sqrt().sum())
    assert res.value == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_normalized_sharpness_bounds_random(seed: int) -> None:
    h, q = solver_problem(11, 17, seed)
    res = solve_normalized_sharpness(h, q)
    assert lower_bound(h, q) <= res.value * (1 + 1e-12)
    assert res.value <= matrix_normalized(h, q) * (1 + 1e-12)


def test_dead_units_are_clamped_and_counted() -> None:
    h, q = solver_problem(6, 8, 0)
    h[2] = 0.0          # a unit no curvature reaches: σ_2 → ∞
    q[:, 5] = 0.0       # an input column with zero weights: σ'_5 → 0
    res = solve_normalized_sharpness(h, q)
    assert (res.dead_rows, res.dead_cols) == (1, 1)
    assert math.isinf(float(res.sigma[2])) and float(res.sigma_prime[5]) == 0.0
    keep_r = [i for i in range(6) if i != 2]
    keep_c = [j for j in range(8) if j != 5]
    sub = solve_normalized_sharpness(h[keep_r][:, keep_c], q[keep_r][:, keep_c])
    assert res.value == pytest.approx(sub.value, rel=1e-12) and math.isfinite(res.value)
    # the infimum: a tiny positive curvature on the dead row only adds a vanishing amount
    h2 = h.clone()
    h2[2] = 1e-20
    assert solve_normalized_sharpness(h2, q).value == pytest.approx(res.value, rel=1e-6)
    empty = solve_normalized_sharpness(torch.zeros(3, 4, dtype=torch.float64), q[:3, :4])
    assert empty.value == 0.0 and empty.dead_rows == 3


@pytest.mark.parametrize("shape", [(120, 400), (84, 120), (16, 6), (10, 84)])
def test_solver_on_lenet_sized_layers(shape: tuple[int, int]) -> None:
    """Converged to its tolerances, between the closed-form bounds, and stationary: no coordinate step
    of the alternating minimization (closed form per row / column) lowers the value. The solver's speed
    on these shapes is measured by scripts/bench_solvers.py, outside the suite."""
    h, q = solver_problem(*shape, 0)
    res = solve_normalized_sharpness(h, q)
    assert res.converged and res.rel_change <= 1e-10 and res.kkt_residual <= 1e-10
    assert lower_bound(h, q) <= res.value * (1 + 1e-12) and res.value <= matrix_normalized(h, q) * (1 + 1e-12)
    s, t = res.sigma, res.sigma_prime
    value_at = float(s @ h @ t + (1 / s) @ q @ (1 / t))
    assert value_at == pytest.approx(res.value, rel=1e-12)
    # one exact block step: σ_i ← sqrt((Q 1/σ')_i / (H σ')_i) minimizes over σ with σ' fixed
    s_step = torch.sqrt((q @ (1 / t)) / (h @ t))
    stepped = float(s_step @ h @ t + (1 / s_step) @ q @ (1 / t))
    assert stepped >= res.value * (1 - 1e-9)


def test_conv_layers_reduce_over_spatial_axes() -> None:
    gen = torch.Generator().manual_seed(0)
    diag = torch.rand(4, 3, 5, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 3, 5, 5, generator=gen, dtype=torch.float64)
    h, q = reduce_layer(diag, w)
    assert h.shape == (4, 3) and torch.allclose(h, diag.sum((2, 3)))
    assert torch.allclose(q, w.pow(2).sum((2, 3)))


# ---------------------------------------------------------------- the measures on trained models


def test_normalized_sharpness_measures_on_a_trained_mlp(tiny_mlp) -> None:
    model, x, y = tiny_mlp
    ns = _run("normalized_sharpness", model, x, y)
    mns = _run("matrix_normalized_sharpness", model, x, y)
    diag = hessian_diagonal(model, x, y, get_loss("ce"))
    assert diag.method == "exact"
    names = ["1", "3", "5"]
    assert set(ns.values) == {"normalized_sharpness"} | {f"normalized_sharpness/{n}" for n in names}
    for n in names:
        h, q = reduce_layer(diag.diag[f"{n}.weight"], model.get_submodule(n).weight)
        closed = 2 * float(model.get_submodule(n).weight.detach().norm()) * math.sqrt(float(h.sum()))
        assert mns.values[f"matrix_normalized_sharpness/{n}"] == pytest.approx(closed, rel=1e-12)
        value = ns.values[f"normalized_sharpness/{n}"]
        # 2 Σ|W| sqrt(H) ≤ NS_l ≤ 2 ‖W‖_F sqrt(Tr H_W)
        assert 2 * float((q.sqrt() * h.sqrt()).sum()) <= value * (1 + 1e-12)
        assert value <= closed * (1 + 1e-12)
        layer = ns.info["layers"][n]
        assert layer["converged"] and layer["rel_change"] <= 1e-10 and layer["iterations"] >= 1
        assert layer["kkt_residual"] <= 1e-10
    assert ns.values["normalized_sharpness"] == pytest.approx(
        sum(ns.values[f"normalized_sharpness/{n}"] for n in names))
    assert ns.info["loss"] == "ce" and ns.info["diagonal_method"] == "exact"
    assert ns.info["dead_units"] == sum(l["dead_rows"] + l["dead_cols"] for l in ns.info["layers"].values())


def test_normalized_sharpness_nce_uses_the_normalized_loss(tiny_mlp) -> None:
    model, x, y = tiny_mlp
    out = _run("normalized_sharpness_nce", model, x, y)
    assert out.info["loss"] == "normalized_ce"
    diag = hessian_diagonal(model, x, y, get_loss("normalized_ce"))
    total = 0.0
    for n in ("1", "3", "5"):
        h, q = reduce_layer(diag.diag[f"{n}.weight"].clamp_min(0), model.get_submodule(n).weight)
        total += solve_normalized_sharpness(h, q).value
    assert out.values["normalized_sharpness_nce"] == pytest.approx(total, rel=1e-10)
    assert out.values["normalized_sharpness_nce"] != pytest.approx(
        _run("normalized_sharpness", model, x, y).values["normalized_sharpness"], rel=1e-3)


# ---------------------------------------------------------------- minimum sharpness


@pytest.mark.parametrize("traces", [[3.0, 0.5], [1.0, 2.0, 3.0, 4.0], [1e-4, 50.0, 2.0], [7.0] * 5])
def test_minimum_sharpness_closed_form(traces: list[float]) -> None:
    res = solve_minimum_sharpness(traces)
    L = len(traces)
    expected = L * math.prod(traces) ** (1 / L)
    assert res.converged and res.value == pytest.approx(expected, rel=1e-12)
    assert res.closed_form == pytest.approx(expected, rel=1e-12)
    # the optimal α makes every rescaled layer trace equal
    alphas = res.alpha
    rescaled = [t / a ** 2 for t, a in zip(traces[:-1], alphas)] + [traces[-1] * math.prod(alphas) ** 2]
    assert max(rescaled) == pytest.approx(min(rescaled), rel=1e-9)


def test_minimum_sharpness_with_biases_matches_generic_optimizer() -> None:
    tw, tb = [2.0, 0.3, 5.0, 1.5], [0.7, 4.0, 0.01, 0.2]
    res = solve_minimum_sharpness(tw, tb)

    def fun(a: np.ndarray) -> float:
        cum = np.cumsum(a)
        return float(sum(tw[l] * np.exp(-2 * a[l]) + tb[l] * np.exp(-2 * cum[l]) for l in range(3))
                     + tw[3] * np.exp(2 * cum[-1]) + tb[3])

    ref = minimize(fun, np.zeros(3), method="BFGS", options={"gtol": 1e-12})
    assert res.converged and res.value <= ref.fun * (1 + 1e-10)
    assert res.value == pytest.approx(ref.fun, rel=1e-8)
    assert res.closed_form is None


def test_minimum_sharpness_is_the_trace_at_the_optimal_rescaling(tiny_mlp) -> None:
    """Apply the reported α to the network: it computes the same function and its Tr H is the value."""
    model, x, y = tiny_mlp
    out = _run("minimum_sharpness", model, x, y)
    alphas = [out.info["alpha"][n] for n in ("1", "3")]
    assert out.info["converged"]
    scaled = _apply_layer_alphas(model, alphas)
    with torch.no_grad():
        assert torch.allclose(scaled(x), model(x), rtol=1e-10, atol=1e-12)
    trace = hessian_diagonal(scaled, x, y, get_loss("ce")).trace()
    assert out.values["minimum_sharpness"] == pytest.approx(trace, rel=1e-9)
    assert out.values["minimum_sharpness"] <= out.info["trace_unscaled"] * (1 + 1e-12)


def _apply_layer_alphas(model: nn.Module, alphas: list[float]) -> nn.Module:
    import copy

    out = copy.deepcopy(model)
    layers = [m for m in out if isinstance(m, nn.Linear)]
    cum = 1.0
    with torch.no_grad():
        for layer, a in zip(layers[:-1], alphas):
            cum *= a
            layer.weight.mul_(a)
            if layer.bias is not None:
                layer.bias.mul_(cum)
        layers[-1].weight.div_(cum)
    return out


def test_minimum_sharpness_measure_closed_form_without_biases(tiny_mlp_nobias) -> None:
    model, x, y = tiny_mlp_nobias
    out = _run("minimum_sharpness", model, x, y)
    tw = list(out.info["weight_traces"].values())
    assert len(tw) == 3 and not any(out.info["bias_traces"].values())
    assert out.values["minimum_sharpness"] == pytest.approx(3 * math.prod(tw) ** (1 / 3), rel=1e-12)


@pytest.mark.parametrize("name", ["mlp_bn", "wrn"])
def test_minimum_sharpness_not_applicable_with_batchnorm(name: str) -> None:
    with pytest.raises(NotApplicable, match="BatchNorm follows a weight layer"):
        _run("minimum_sharpness", *_case(name))


# ---------------------------------------------------------------- PSI-flatness and basis paths


def test_basis_path_count_is_m_minus_h() -> None:
    for widths, d, c in [((5,), 7, 3), ((6, 6), 4, 9), ((3, 3, 3), 10, 2)]:
        model = MLP(d, widths, c, bias=False).double()
        m = sum(p.numel() for p in model.parameters())
        paths = basis_paths(model)
        assert paths.count == m - sum(widths)
        assert paths.flat().numel() == m - sum(widths)


def test_network_rebuilt_from_basis_path_values_has_the_same_logits(psi_mlp) -> None:
    model, x, _ = psi_mlp
    paths = basis_paths(model)
    weights = rebuild(paths.chain_values, paths.values, paths.signs, paths.shapes)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
        for name, w in zip(paths.names, weights):
            clone.get_submodule(name).weight.copy_(w)
        assert torch.allclose(clone(x), model(x), rtol=1e-10, atol=1e-12)
    # the rebuilt network is normalized (skeleton ±1 outside the last layer) and has the same basis values
    again = basis_paths(clone)
    assert torch.allclose(again.flat(), paths.flat(), rtol=1e-12, atol=0)
    r, c = paths.skeleton[0]
    width = clone.get_submodule(paths.names[0]).out_features
    assert torch.equal(clone.get_submodule(paths.names[0]).weight[r, c].abs().detach(),
                       torch.ones(width, dtype=torch.float64))
    # and the basis values are unchanged by node-wise rescaling
    scaled = rescale.transform(model, "node", torch.Generator().manual_seed(0))
    assert torch.allclose(basis_paths(scaled).flat(), paths.flat(), rtol=1e-10, atol=0)


def test_psi_flatness_equals_autograd_through_the_basis_map(psi_mlp) -> None:
    model, x, y = psi_mlp
    paths = basis_paths(model)
    h = paths.chain_values.numel()
    flat = paths.flat()

    def loss_of(v: torch.Tensor) -> torch.Tensor:
        chain, values, offset = v[:h], [], h
        for mask in paths.masks:
            k = int((~mask).sum())
            values.append(torch.zeros(mask.shape, dtype=v.dtype).masked_scatter(~mask, v[offset:offset + k]))
            offset += k
        weights = rebuild(chain, values, paths.signs, paths.shapes)
        params = {f"{n}.weight": w for n, w in zip(paths.names, weights)}
        logits = torch.func.functional_call(model, params, (x,))
        return nn.functional.cross_entropy(logits, y)

    full = torch.autograd.functional.hessian(loss_of, flat)
    out = _run("psi_flatness", model, x, y)
    assert out.values["psi_flatness"] == pytest.approx(float(full.diagonal().sum()), rel=1e-9)
    assert out.values["psi_flatness/chains"] == pytest.approx(float(full.diagonal()[:h].sum()), rel=1e-9)
    ratio = _run("psi_path_ratio", model, x, y)
    assert ratio.values["psi_path_ratio"] == pytest.approx(float(flat.abs().max() / flat.abs().min()))
    assert ratio.info["basis_paths"] == flat.numel()


def _chain_curvature_by_autograd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_name: str
                                 ) -> torch.Tensor:
    """∂²L/∂v_c² of every chain by forward-over-forward autograd through θ(t) (the measure's first
    implementation, kept here as the independent reference of its closed form): moving v_c to t_c
    multiplies chain c's last-layer skeleton weight by r_c = t_c / v_c and divides the non-skeleton
    weights of row c in layers 0..L−2 by r_c."""
    paths = basis_paths(model)
    names, L = paths.names, len(paths.names)
    params = {n: p.detach() for n, p in model.named_parameters()}
    v = paths.chain_values
    last_r, last_c = paths.skeleton[L - 1]
    loss = get_loss(loss_name)

    def theta(t: torch.Tensor) -> dict[str, torch.Tensor]:
        r = t / v
        out = dict(params)
        for l, n in enumerate(names[:-1]):
            out[f"{n}.weight"] = params[f"{n}.weight"] * (1 + (~paths.masks[l]).double() * (1 / r[:, None] - 1))
        scale = torch.ones_like(params[f"{names[-1]}.weight"]).index_put((last_r, last_c), r)
        out[f"{names[-1]}.weight"] = params[f"{names[-1]}.weight"] * scale
        return out

    def fn(t: torch.Tensor) -> torch.Tensor:
        return loss(torch.func.functional_call(model, theta(t), (x,)), y)

    def second(direction: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(lambda t: torch.func.jvp(fn, (t,), (direction,))[1], (v,), (direction,))[1]

    return torch.stack([second(e) for e in torch.eye(v.numel(), dtype=torch.float64)])


@pytest.mark.parametrize("hidden", [(6,), (5, 5), (4, 4, 4)])
@pytest.mark.parametrize("loss_name", ["ce", "normalized_ce"])
def test_psi_chain_curvature_in_closed_form_equals_autograd_through_theta(hidden, loss_name) -> None:
    """The closed-form second-order forward pass (`psi._chain_curvature`) against autograd through the
    curve θ(t), for one, two and three hidden layers, in chain blocks smaller than the width."""
    from flatbench.measures.builtin.psi import _chain_curvature

    torch.manual_seed(len(hidden))
    model = MLP(12, hidden, 5, bias=False).double().eval()
    x, y = _data(40, (12,), 5, seed=len(hidden))
    with torch.no_grad():  # off initialization: some ReLUs off, a non-zero gradient term
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    reference = _chain_curvature_by_autograd(model, x, y, loss_name)
    ctx = MeasureContext(model=model, inputs=x, targets=y, num_classes=5, loss_name=loss_name, chunk_size=16)
    paths = basis_paths(model)
    for batch in (1, 3, 64):
        ours = _chain_curvature(ctx, paths.names, paths, batch)
        assert torch.allclose(ours, reference, rtol=1e-9, atol=1e-12 * float(reference.abs().max())), batch


PSI_NOT_APPLICABLE = {  # model: a part of the reason both psi measures must give
    "mlp": "has a bias", "mlp_nobias": "needs equal hidden widths, got [16, 12]", "lenet": "'0' is a Conv2d",
    "wrn": "WideResNet is not a plain Sequential MLP", "batch_norm": "'2' is a BatchNorm1d",
    "no_hidden": "needs at least one hidden layer"}


@pytest.mark.parametrize("which", list(PSI_NOT_APPLICABLE))
def test_psi_not_applicable_says_why(which: str) -> None:
    if which in ("batch_norm", "no_hidden"):  # structures the catalogue has no case for
        model = {"batch_norm": lambda: MLP(5, (4, 4), 3, bias=False, batch_norm=True),
                 "no_hidden": lambda: MLP(5, (), 3, bias=False)}[which]().double().eval()
        x, y = _data(8, (5,), 3)
    else:
        model, x, y = _case(which)
    for name in ("psi_flatness", "psi_path_ratio"):
        with pytest.raises(NotApplicable) as exc:
            _run(name, model, x, y)
        assert PSI_NOT_APPLICABLE[which] in str(exc.value), str(exc.value)
