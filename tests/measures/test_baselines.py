"""The baseline measures of issue 5: closed forms, searches, invariances (float64, tiny nets)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math

import pytest
import torch
from cases import case
from torch import nn

from flatbench import rescale
from flatbench.measures import all_measures
from flatbench.measures.context import MeasureContext
from flatbench.measures.builtin.pacbayes import accuracy_drops, draw_perturbation
from flatbench.measures.builtin.rangamani import scaled_top_eigenvalue
from flatbench.measures.builtin.relative_flatness import last_linear
from flatbench.measures.builtin.sharpness import (
    adaptive_average_case,
    adaptive_worst_case,
    ascend,
    flatten,
    param_dict,
)

DT = torch.float64
MINE = ("fisher_rao_norm", "eps_sharpness", "pacbayes_flatness", "pacbayes_mag_flatness",
        "adaptive_sharpness_l2", "adaptive_sharpness_linf", "adaptive_sharpness_avg", "relative_flatness",
        "relative_flatness_normalized",
        "scale_invariant_rangamani")


# ---------------------------------------------------------------- fixtures and helpers
#
# The trained models are the catalogue's (tests/cases.py): `trained` is the MLP with biases, `trained_bias_free`
# the one without, `trained_bn` the MLP with BatchNorm, all on their 64 mnist_mini rows (`data`). The
# invariances these measures declare are checked by the matrix (tests/measures/test_invariance.py); the tests here
# check values (closed forms, brute force), the searches, and the few rescalings the matrix does not do.


@pytest.fixture(scope="module")
def data():
    c = case("mlp")
    return c.inputs, c.targets


@pytest.fixture(scope="module")
def trained():
    return case("mlp").model


@pytest.fixture(scope="module")
def trained_bias_free():
    return case("mlp_nobias").model


@pytest.fixture(scope="module")
def trained_bn():
    return case("mlp_bn").model


def _run(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_size: int = 150, **settings):
    spec = all_measures()[name]
    ctx = MeasureContext(model=model, inputs=x, targets=y, num_classes=int(y.max()) + 1,
                         chunk_size=chunk_size)
    out = spec.fn(ctx.for_measure(name, {**spec.defaults, **settings}))
    return out.values[name], out.info


def _ctx(model, x, y, name="test", chunk_size=150, **settings) -> MeasureContext:
    ctx = MeasureContext(model=model, inputs=x, targets=y, num_classes=int(y.max()) + 1,
                         chunk_size=chunk_size)
    return ctx.for_measure(name, settings)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def node_rescale(model: nn.Module, seed: int = 1) -> nn.Module:
    """Each hidden unit i: incoming row (and bias) × c_i, outgoing column ÷ c_i (c log-uniform, [0.1, 10])."""
    return rescale.transform(model, "node", torch.Generator().manual_seed(seed))


@torch.no_grad()
def last_hidden_rescale(model: nn.Module, seed: int = 1) -> nn.Module:
    """Only the units of the last hidden layer (the features relative flatness sees) are rescaled."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    inc, out = _linears(model)[-2:]
    c = rescale.log_uniform(inc.out_features, gen)
    inc.weight.mul_(c[:, None])
    if inc.bias is not None:
        inc.bias.mul_(c)
    out.weight.div_(c[None, :])
    return model


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def _same_function(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- registry


def test_registered_with_metadata():
    reg = all_measures()
    for name in MINE:
        spec = reg[name]
        assert spec.description and "\n" not in spec.description
        assert spec.cost in ("cheap", "gradient", "hessian", "search")
    assert reg["fisher_rao_norm"].invariant_to == {"layer", "node", "bn"}
    assert reg["scale_invariant_rangamani"].invariant_to == {"layer", "bn"}
    assert reg["relative_flatness"].invariant_to == {"layer", "bn"}
    assert reg["eps_sharpness"].invariant_to == set() and reg["eps_sharpness"].defaults["eps"] == 1e-3
    for name in ("pacbayes_flatness", "pacbayes_mag_flatness", "adaptive_sharpness_avg"):
        assert reg[name].stochastic and not reg[name].exact
    assert reg["pacbayes_mag_flatness"].defaults["eps"] == 1e-3
    assert reg["pacbayes_flatness"].defaults["search_depth"] == 15
    assert reg["pacbayes_flatness"].defaults["samples"] == 10
    assert not reg["pacbayes_flatness"].uses_loss and reg["eps_sharpness"].uses_loss


# ---------------------------------------------------------------- Fisher-Rao


def test_fisher_rao_closed_form_bias_free(trained_bias_free, data):
    x, y = data
    value, _ = _run("fisher_rao_norm", trained_bias_free, x, y)
    with torch.no_grad():
        f = trained_bias_free(x)
    p = torch.softmax(f, dim=1)
    layers = len(_linears(trained_bias_free))  # L + 1 weight layers
    expected = layers ** 2 * float((((p * f).sum(1) - f.gather(1, y[:, None])[:, 0]) ** 2).mean())
    assert value == pytest.approx(expected, rel=1e-10)


# ---------------------------------------------------------------- ε-sharpness and the ascent


def test_eps_sharpness_nonnegative_and_grows_with_eps(trained, data):
    x, y = data
    values = [_run("eps_sharpness", trained, x, y, eps=eps)[0] for eps in (1e-4, 1e-3, 1e-2)]
    assert values[0] >= 0
    assert values[0] < values[1] < values[2]


def test_ascent_matches_analytic_box_maximum_on_quadratic():
    # Separable convex quadratic: the maximum over the box is, per coordinate, the endpoint farther from
    # the minimizer m.
    gen = torch.Generator().manual_seed(0)
    d = 50
    a = torch.rand(d, generator=gen, dtype=DT) + 0.1
    theta = torch.randn(d, generator=gen, dtype=DT)
    m = theta + 0.01 * torch.randn(d, generator=gen, dtype=DT)
    eps = 0.05
    scale = eps * (theta.abs() + 1)

    def objective(delta):
        r = theta + delta - m
        return float(0.5 * (a * r * r).sum()), a * r

    result = ascend(objective, scale, rho=1.0, norm="linf", iters=20)
    analytic = float(0.5 * (a * ((theta - m).abs() + scale) ** 2).sum())
    assert result.value == pytest.approx(analytic, rel=1e-12)
    assert result.base == pytest.approx(float(0.5 * (a * (theta - m) ** 2).sum()), rel=1e-12)
    assert float((result.u.abs() - 1).max()) <= 1e-12


def test_ascent_near_vertex_maximum_on_dense_quadratic():
    # Dense convex quadratic: the maximum over a box is at a vertex; compare with enumeration.
    gen = torch.Generator().manual_seed(5)
    d = 5
    b = torch.randn(d, d, generator=gen, dtype=DT)
    a = b.t() @ b + 0.1 * torch.eye(d, dtype=DT)
    theta = torch.randn(d, generator=gen, dtype=DT)
    scale = 0.1 * (theta.abs() + 1)

    def objective(delta):
        r = theta + delta
        return float(0.5 * r @ a @ r), a @ r

    result = ascend(objective, scale, rho=1.0, norm="linf", iters=20)
    best = max(objective(scale * torch.tensor(s, dtype=DT))[0]
               for s in itertools.product((-1.0, 1.0), repeat=d))
    assert result.value <= best * (1 + 1e-12)
    assert result.value >= 0.98 * best


def _linear_model(weight: list[list[float]], bias: list[float]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A linear classifier: its cross-entropy is convex in (W, b), so a maximum over a box is at a vertex."""
    model = nn.Linear(len(weight[0]), len(weight)).to(DT)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight, dtype=DT))
        model.bias.copy_(torch.tensor(bias, dtype=DT))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, len(weight[0]), generator=gen, dtype=DT)
    y = torch.randint(0, len(weight), (24,), generator=gen)
    return model.eval(), x, y


def _eps_sharpness_by_enumeration(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float) -> float:
    """100 (max over the 2^d vertices of the box |z_i| ≤ ε(|θ_i| + 1) of L(θ + z) − L(θ)) / (1 + L(θ))."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p):
        return float(nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y))

    base = loss(params)
    names = list(params)
    sizes = [params[k].numel() for k in names]
    best = base
    for signs in itertools.product((-1.0, 1.0), repeat=sum(sizes)):
        s = torch.split(torch.tensor(signs, dtype=DT), sizes)
        best = max(best, loss({k: params[k] + si.view_as(params[k]) * eps * (params[k].abs() + 1)
                               for k, si in zip(names, s)}))
    return 100 * (best - base) / (1 + base)


@pytest.mark.parametrize("weight,bias", [
    ([[0.8, 0.0, -0.4], [0.0, 0.3, 1.1]], [0.2, 0.0]),   # some parameters exactly 0
    ([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [0.0, 0.0]),    # all 0: the box is |z| ≤ ε, not the point 0
])
def test_eps_sharpness_box_by_brute_force(weight, bias):
    model, x, y = _linear_model(weight, bias)
    eps = 0.05
    expected = _eps_sharpness_by_enumeration(model, x, y, eps)
    value, info = _run("eps_sharpness", model, x, y, eps=eps)
    with torch.no_grad():
        base = float(nn.functional.cross_entropy(model(x), y))
    assert expected > 0 and info["loss"] == pytest.approx(base, rel=1e-12)
    # APGD's result is a lower bound of the maximum; on this convex, nearly linear problem it is the maximum
    assert value <= expected * (1 + 1e-12)
    assert value == pytest.approx(expected, rel=1e-9)


def test_eps_sharpness_reports_search(trained, data):
    x, y = data
    value, info = _run("eps_sharpness", trained, x, y)
    assert info["iterations"] == 20 and isinstance(info["converged"], bool)
    assert value == pytest.approx(100 * (info["max_loss"] - info["loss"]) / (1 + info["loss"]), rel=1e-12)


# ---------------------------------------------------------------- PAC-Bayes


@pytest.mark.parametrize("name", ["pacbayes_flatness", "pacbayes_mag_flatness"])
def test_pacbayes_sigma_meets_target_with_fresh_samples(name, trained, data):
    x, y = data
    value, info = _run(name, trained, x, y)
    assert info["met_target"] and info["samples"] == 10
    sigma = info["sigma"]
    assert value == pytest.approx(1 / sigma ** 2)
    assert abs(info["accuracy_drop"] - 0.1) <= 0.01
    ctx = _ctx(trained, x, y, name="fresh")
    fresh = [torch.Generator().manual_seed(10_000 + i) for i in range(40)]
    drops = accuracy_drops(ctx, sigma, fresh, info["accuracy"], info.get("magnitude_eps"))
    se = math.hypot(float(drops.std()) / math.sqrt(len(fresh)), info["accuracy_drop_stderr"])
    assert abs(float(drops.mean()) - 0.1) <= 0.01 + 3 * se
    again, _ = _run(name, trained, x, y)
    assert again == value  # the seeded generator: same value on a re-run



@pytest.mark.parametrize("name", ["pacbayes_flatness", "pacbayes_mag_flatness"])
def test_pacbayes_kept_draws_equal_draws_made_again_at_every_sigma(name, trained, data):
    """The search keeps its standard-normal draws across σ when they fit the memory budget; without room
    (max_memory_mb = 0) it draws them again at each σ: the same numbers, so the same σ' and evaluations."""
    from flatbench.measures.builtin.pacbayes import sigma_search

    x, y = data
    spec = all_measures()[name]
    eps = spec.defaults.get("eps")
    ctx = _ctx(trained, x, y, name=name, **spec.defaults)
    kept = sigma_search(ctx, eps)
    again = sigma_search(dataclasses.replace(ctx, max_memory_mb=0), eps)
    assert kept[0] == again[0]
    assert kept[1]["evaluations"] == again[1]["evaluations"] and len(kept[1]["evaluations"]) > 3

def test_magnitude_aware_noise_has_the_stated_variance():
    rows = torch.tensor([0.0, 0.01, 0.3, 2.0, 5.0], dtype=DT)
    params = {"w": rows[:, None].expand(5, 20_000).clone()}
    sigma, eps = 0.5, 1e-3
    gen = torch.Generator().manual_seed(0)
    var = draw_perturbation(params, sigma, gen, magnitude_eps=eps)["w"].var(dim=1)
    expected = sigma ** 2 * rows ** 2 + eps ** 2
    torch.testing.assert_close(var, expected, rtol=0.05, atol=0.0)
    plain = draw_perturbation(params, sigma, gen)["w"].var(dim=1)
    torch.testing.assert_close(plain, torch.full_like(plain, sigma ** 2), rtol=0.05, atol=0.0)


def test_pacbayes_on_a_model_that_does_not_fit_its_data_is_not_applicable(data):
    from flatbench.measures.registry import NotApplicable

    x, y = data
    model = case("mlp").copy()
    with torch.no_grad():  # constant logits: predicts class 0, noise cannot lower accuracy by 0.1
        model[-1].weight.zero_()
        model[-1].bias.zero_()
        model[-1].bias[0] = 5.0
    with pytest.raises(NotApplicable, match="does not fit its data.*chance"):
        _run("pacbayes_flatness", model, x, y, max_expansions=2)


# ---------------------------------------------------------------- adaptive sharpness


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_adaptive_perturbation_stays_in_its_ball(norm, trained, data):
    x, y = data
    model = copy.deepcopy(trained)
    with torch.no_grad():
        model[1].weight[0, :3] = 0.0  # zero parameters must never move
    rho = 0.3 if norm == "l2" else 0.01
    ctx = _ctx(model, x, y)
    value, info, deltas = adaptive_worst_case(ctx, rho=rho, norm=norm, iters=20, batch_size=24,
                                              keep_deltas=True)
    assert value > 0 and info["batches"] == 3 and len(deltas) == 3
    theta = flatten(param_dict(model))
    zero = theta == 0
    for delta in deltas:
        assert bool((delta[zero] == 0).all())
        u = delta[~zero] / theta[~zero].abs()
        size = float(u.norm()) if norm == "l2" else float(u.abs().max())
        assert size <= rho * (1 + 1e-12)


def test_adaptive_worst_case_at_least_average_case(trained, data):
    x, y = data
    rho = 0.05
    worst, _ = _run("adaptive_sharpness_linf", trained, x, y, rho=rho)
    avg, info = _run("adaptive_sharpness_avg", trained, x, y, rho=rho)
    assert info["samples"] == 20 * math.ceil(len(x) / 128) and info["stderr"] > 0
    assert worst >= avg + 3 * info["stderr"]


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_adaptive_worst_case_node_rescaling_vs_plain(norm, trained, data):
    x, y = data
    rho = 0.3 if norm == "l2" else 0.01
    rescaled = node_rescale(trained)
    _same_function(trained, rescaled, x)

    def both(model):
        ctx = _ctx(model, x, y)
        return [adaptive_worst_case(ctx, rho=rho, norm=norm, iters=20, batch_size=128, adaptive=a)[0]
                for a in (True, False)]

    (adaptive0, plain0), (adaptive1, plain1) = both(trained), both(rescaled)
    assert _rel(adaptive0, adaptive1) < 1e-6
    assert _rel(plain0, plain1) > 100 * max(_rel(adaptive0, adaptive1), 1e-8)


def test_adaptive_average_case_reproducible_with_common_random_numbers(trained, data):
    x, y = data
    base = adaptive_average_case(_ctx(trained, x, y), rho=0.1, samples=10, batch_size=128)[0]
    again = adaptive_average_case(_ctx(trained, x, y), rho=0.1, samples=10, batch_size=128)[0]
    assert again == base
    # the same seeded draws z, scaled by |θ|: a rescaled model sees the rescaled perturbations
    value = adaptive_average_case(_ctx(node_rescale(trained), x, y), rho=0.1, samples=10, batch_size=128)[0]
    assert _rel(value, base) < 1e-12
    other = adaptive_average_case(_ctx(trained, x, y, name="other"), rho=0.1, samples=10, batch_size=128)[0]
    assert other != base  # the draws depend on the measure's name (its generator's seed)


# ---------------------------------------------------------------- relative flatness


def _petzka_by_autograd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Σ_{s,s'} ⟨w_s, w_s'⟩ Tr H_{s,s'} with the last layer's Hessian block from autograd (rows w_s)."""
    _, layer = last_linear(model)
    w0 = layer.weight.detach().clone()
    params = {k: v.detach() for k, v in model.named_parameters()}
    key = [k for k, v in model.named_parameters() if v is layer.weight][0]

    def loss_of(w):
        out = torch.func.functional_call(model, {**params, key: w}, (x,))
        return nn.functional.cross_entropy(out, y)

    h = torch.autograd.functional.hessian(loss_of, w0)  # (C, m, C, m)
    c = w0.shape[0]
    total = 0.0
    for s in range(c):
        for t in range(c):
            total += float(w0[s] @ w0[t]) * float(torch.diagonal(h[s, :, t, :]).sum())
    return total


def test_relative_flatness_equals_petzka_definition(trained, data):
    x, y = data
    value, info = _run("relative_flatness", trained, x, y)
    assert info["layer"] == "5"
    assert value == pytest.approx(_petzka_by_autograd(trained, x, y), rel=1e-10)


def test_relative_flatness_under_feature_rescaling(trained, data):
    """Rescaling only the feature units (the last hidden layer) leaves the normalized variant unchanged and
    moves Petzka's κ (the matrix checks the full families; this is the rescaling κ is built around)."""
    x, y = data
    base, _ = _run("relative_flatness", trained, x, y)
    base_norm, _ = _run("relative_flatness_normalized", trained, x, y)
    node = last_hidden_rescale(trained)
    _same_function(trained, node, x)
    assert _rel(_run("relative_flatness_normalized", node, x, y)[0], base_norm) < 1e-10
    assert _rel(_run("relative_flatness", node, x, y)[0], base) > 1e-3


def test_relative_flatness_needs_logit_layer(data):
    x, y = data
    model = nn.Sequential(case("mlp").copy(), nn.ReLU()).eval()
    from flatbench.measures.registry import NotApplicable
    with pytest.raises(NotApplicable):
        _run("relative_flatness", model, x, y)


# ---------------------------------------------------------------- Rangamani


def _explicit_scaled_top_eigenvalue(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = [k for k in params if k.endswith("weight")]
    flat = torch.cat([params[k].reshape(-1) for k in names])

    def loss_of(v):
        chunks = torch.split(v, [params[k].numel() for k in names])
        new = {**params, **{k: c.view_as(params[k]) for k, c in zip(names, chunks)}}
        return nn.functional.cross_entropy(torch.func.functional_call(model, new, (x,)), y)

    h = torch.autograd.functional.hessian(loss_of, flat)
    d = torch.cat([params[k].norm().expand(params[k].numel()) for k in names])
    return float(torch.linalg.eigvalsh(d[:, None] * h * d[None, :]).max())


def test_rangamani_power_iteration_matches_explicit_eigenvalue(trained, data):
    x, y = data
    expected = _explicit_scaled_top_eigenvalue(trained, x, y)
    lam, info = scaled_top_eigenvalue(_ctx(trained, x, y), tol=1e-12, max_iter=3000)
    assert info["converged"]
    assert lam == pytest.approx(expected, rel=1e-6)
    value, info = _run("scale_invariant_rangamani", trained, x, y)
    # the default stopping rule (residual ≤ tol·|λ|, tol = 1e-4) puts λ within tol of an eigenvalue
    assert info["converged"] and info["residual"] <= 1e-4
    assert info["lambda_max"] == pytest.approx(expected, rel=1e-4)
    assert value == pytest.approx(info["lambda_max"] / (2 + 2 * info["loss"]), rel=1e-12)
