"""The baseline measures of issue 5: closed forms, searches, invariances (float64, tiny nets)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

from flatbench.measures import all_measures
from flatbench.measures.context import MeasureContext
from flatbench.measures.pacbayes import SearchFailed, accuracy_drops, draw_perturbation
from flatbench.measures.rangamani import scaled_top_eigenvalue
from flatbench.measures.relative_flatness import last_linear
from flatbench.measures.sharpness import (adaptive_average_case, adaptive_worst_case, ascend, flatten,
                                          param_dict)

DT = torch.float64
MINE = ("fisher_rao_norm", "eps_sharpness", "pacbayes_flatness", "pacbayes_mag_flatness",
        "adaptive_sharpness_l2", "adaptive_sharpness_linf", "adaptive_sharpness_avg", "relative_flatness",
        "relative_flatness_normalized",
        "scale_invariant_rangamani")


# ---------------------------------------------------------------- fixtures and helpers


def _data(n: int = 360, d: int = 6, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    teacher = torch.randn(d, classes, generator=gen, dtype=DT)
    return x, (x @ teacher).argmax(dim=1)


def _mlp(bias: bool = True, batch_norm: bool = False, widths=(16, 12), d: int = 6, classes: int = 3,
         seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    prev = d
    for w in widths:
        layers.append(nn.Linear(prev, w, bias=bias))
        if batch_norm:
            layers.append(nn.BatchNorm1d(w))
        layers.append(nn.ReLU())
        prev = w
    layers.append(nn.Linear(prev, classes, bias=bias))
    return nn.Sequential(*layers).to(DT)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 300) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.fixture(scope="module")
def trained(data):
    x, y = data
    return _train(_mlp(), x, y)


@pytest.fixture(scope="module")
def trained_bias_free(data):
    x, y = data
    return _train(_mlp(bias=False), x, y)


@pytest.fixture(scope="module")
def trained_bn(data):
    x, y = data
    model = _train(_mlp(batch_norm=True), x, y)
    gen = torch.Generator().manual_seed(3)
    for m in model.modules():  # non-trivial running statistics
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen, dtype=DT) * 0.3)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen, dtype=DT) + 0.5)
    return model


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


def _log_uniform(shape, gen) -> torch.Tensor:
    return torch.exp((torch.rand(shape, generator=gen, dtype=DT) * 2 - 1) * math.log(10.0))


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def node_rescale(model: nn.Module, seed: int = 1, only_last_hidden: bool = False) -> nn.Module:
    """Each hidden unit i: incoming row (and bias) × c_i, outgoing column ÷ c_i (c log-uniform, [0.1, 10])."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    lin = _linears(model)
    pairs = list(zip(lin[:-1], lin[1:]))
    for inc, out in pairs[-1:] if only_last_hidden else pairs:
        c = _log_uniform(inc.out_features, gen)
        inc.weight.mul_(c[:, None])
        if inc.bias is not None:
            inc.bias.mul_(c)
        out.weight.div_(c[None, :])
    return model


@torch.no_grad()
def layer_rescale(model: nn.Module, seed: int = 2) -> nn.Module:
    """Each weight layer l < L: (W_l, b_l) × α_l and W_{l+1} ÷ α_l, in turn (α log-uniform in [0.1, 10])."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    lin = _linears(model)
    for inc, out in zip(lin[:-1], lin[1:]):
        alpha = float(_log_uniform((), gen))
        inc.weight.mul_(alpha)
        if inc.bias is not None:
            inc.bias.mul_(alpha)
        out.weight.div_(alpha)
    return model


@torch.no_grad()
def bn_rescale(model: nn.Module, seed: int = 4) -> nn.Module:
    """Each Linear followed by BatchNorm1d: (W, b) × c, running mean × c, running variance (and eps) × c²."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    mods = list(model)
    for lin, bn in zip(mods[:-1], mods[1:]):
        if isinstance(lin, nn.Linear) and isinstance(bn, nn.BatchNorm1d):
            c = float(_log_uniform((), gen))
            lin.weight.mul_(c)
            if lin.bias is not None:
                lin.bias.mul_(c)
            bn.running_mean.mul_(c)
            bn.running_var.mul_(c * c)
            bn.eps = bn.eps * c * c
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


@pytest.mark.parametrize("which", ["trained_bias_free", "trained"])
def test_fisher_rao_node_and_layer_invariant(which, request, data):
    model = request.getfixturevalue(which)
    x, y = data
    base, _ = _run("fisher_rao_norm", model, x, y)
    for transformed in (node_rescale(model), layer_rescale(model)):
        _same_function(model, transformed, x)
        assert _rel(_run("fisher_rao_norm", transformed, x, y)[0], base) < 1e-8


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


def test_pacbayes_failure_to_bracket_is_an_error(data):
    x, y = data
    model = _mlp()
    with torch.no_grad():  # constant logits: predicts class 0, noise cannot lower accuracy by 0.1
        model[-1].weight.zero_()
        model[-1].bias.copy_(torch.tensor([5.0, 0.0, 0.0], dtype=DT))
    model.eval()
    with pytest.raises(SearchFailed, match="bracket"):
        _run("pacbayes_flatness", model, x, y, max_expansions=2)


# ---------------------------------------------------------------- adaptive sharpness


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_adaptive_perturbation_stays_in_its_ball(norm, trained, data):
    x, y = data
    model = copy.deepcopy(trained)
    with torch.no_grad():
        model[0].weight[0, :3] = 0.0  # zero parameters must never move
    rho = 0.3 if norm == "l2" else 0.01
    ctx = _ctx(model, x, y)
    value, info, deltas = adaptive_worst_case(ctx, rho=rho, norm=norm, iters=20, batch_size=128,
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
    assert info["samples"] == 60 and info["stderr"] > 0
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


def test_adaptive_average_case_invariant_and_reproducible(trained, data):
    x, y = data
    base = adaptive_average_case(_ctx(trained, x, y), rho=0.1, samples=10, batch_size=128)[0]
    again = adaptive_average_case(_ctx(trained, x, y), rho=0.1, samples=10, batch_size=128)[0]
    assert again == base
    for transformed in (node_rescale(trained), layer_rescale(trained)):
        value = adaptive_average_case(_ctx(transformed, x, y), rho=0.1, samples=10, batch_size=128)[0]
        assert _rel(value, base) < 1e-8


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
    assert info["layer"] == "4"
    assert value == pytest.approx(_petzka_by_autograd(trained, x, y), rel=1e-10)


def test_relative_flatness_invariances(trained, trained_bn, data):
    x, y = data
    base, _ = _run("relative_flatness", trained, x, y)
    base_norm, _ = _run("relative_flatness_normalized", trained, x, y)
    layer = layer_rescale(trained)
    _same_function(trained, layer, x)
    assert _rel(_run("relative_flatness", layer, x, y)[0], base) < 1e-10
    assert _rel(_run("relative_flatness_normalized", layer, x, y)[0], base_norm) < 1e-10
    for node in (node_rescale(trained), node_rescale(trained, only_last_hidden=True)):
        _same_function(trained, node, x)
        assert _rel(_run("relative_flatness_normalized", node, x, y)[0], base_norm) < 1e-10
        # Rescaling the feature units is not a symmetry of Petzka's κ (hence "node" is not declared).
        assert _rel(_run("relative_flatness", node, x, y)[0], base) > 1e-3
    bn_base, _ = _run("relative_flatness", trained_bn, x, y)
    bn = bn_rescale(trained_bn)
    _same_function(trained_bn, bn, x)
    assert _rel(_run("relative_flatness", bn, x, y)[0], bn_base) < 1e-9


def test_relative_flatness_needs_logit_layer(data):
    x, y = data
    model = nn.Sequential(_mlp(), nn.ReLU()).eval()
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


def test_rangamani_layer_and_bn_invariant(trained, trained_bn, data):
    x, y = data
    base, _ = _run("scale_invariant_rangamani", trained, x, y)
    layer = layer_rescale(trained)
    assert _rel(_run("scale_invariant_rangamani", layer, x, y)[0], base) < 1e-8
    node = node_rescale(trained)
    assert _rel(_run("scale_invariant_rangamani", node, x, y)[0], base) > 1e-3  # not node-invariant
    bn_base, _ = _run("scale_invariant_rangamani", trained_bn, x, y)
    assert _rel(_run("scale_invariant_rangamani", bn_rescale(trained_bn), x, y)[0], bn_base) < 1e-8


# ---------------------------------------------------------------- BatchNorm and conv nets


def test_bn_invariance_of_fisher_rao_and_adaptive(trained_bn, data):
    x, y = data
    bn = bn_rescale(trained_bn)
    _same_function(trained_bn, bn, x)
    for name, tol in (("fisher_rao_norm", 1e-8), ("adaptive_sharpness_linf", 1e-6),
                      ("adaptive_sharpness_avg", 1e-8)):
        assert _rel(_run(name, bn, x, y)[0], _run(name, trained_bn, x, y)[0]) < tol, name


def test_all_run_on_a_small_conv_net():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 1, 8, 8, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (96,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(36, 10), nn.ReLU(), nn.Linear(10, 3)).to(DT)
    model = _train(model, x, y, steps=200)
    for name in MINE:
        value, _ = _run(name, model, x, y, chunk_size=40)
        assert math.isfinite(value), name
