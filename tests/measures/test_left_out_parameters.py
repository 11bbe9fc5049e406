"""Issue 41, "weights that norms skip": every parameter a measure leaves out is covered or named.

The measures over a selection of the parameters (the norms, matrix-normalized and normalized sharpness,
Rangamani's metric) work over `flatbench.measures.layers.weight_matrices` and name what they leave out in
`info["left_out"]` (`biases`, `normalization`, `other`). On a small float64 transformer-like model
(Embedding on integer tokens, a raw positional parameter, Conv1d, LayerNorm, nn.MultiheadAttention, RMSNorm,
a head defined before the attention) measured through `flatbench.measure`, each parameter either changes the
value when it is scaled or is named; the norms are checked against brute-force sums over exactly the
documented matrices; and on the catalogue's architectures (the committed studies' MLPs, LeNet, WRN) the
selection is the Linear/Conv2d layers as before, nothing but biases and BatchNorm is left out, and the
values equal brute-force computations.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from cases import CASES, case, context, dense_hessian
from torch import nn

import flatbench
from flatbench.measures import shared
from flatbench.measures.builtin.normalized import reduce_layer, solve_normalized_sharpness
from flatbench.measures.layers import weight_matrices

DIM, LENGTH, VOCAB, CLASSES = 4, 4, 7, 3


class TinyTransformer(nn.Module):
    """Token embedding plus a raw positional parameter, a Conv1d over the sequence, a pre-norm attention
    block and an RMSNorm before mean pooling. The head is defined before the attention, whose `out_proj` is
    also an nn.Linear: the feature → logit layer must still be the head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(0.5 * torch.randn(1, LENGTH, DIM))
        self.head = nn.Linear(DIM, CLASSES)
        self.mix = nn.Conv1d(DIM, DIM, 3, padding=1)
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.norm2 = nn.RMSNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.emb(tokens) + self.pos
        t = t + self.mix(t.transpose(1, 2)).transpose(1, 2)
        h = self.norm1(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.norm2(t).mean(dim=1))


def _model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The transformer, fitted for 30 Adam steps (seeded, float64), and its 12 token sequences."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (12, LENGTH), generator=gen)
    y = torch.arange(12) % CLASSES
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyTransformer().double()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(30):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval(), x, y


MATRICES = ["emb.weight", "mix.weight", "attn.in_proj_weight", "attn.out_proj.weight", "head.weight"]
"""The documented weight matrices of TinyTransformer (in_proj_weight as its three blocks q, k, v)."""
LEFT_OUT = {"biases": ["head.bias", "mix.bias", "attn.in_proj_bias", "attn.out_proj.bias"],
            "normalization": ["norm1.weight", "norm1.bias", "norm2.weight"], "other": ["pos"]}

SUBSET = ["frobenius_norm", "frobenius_norm_product", "spectral_norm", "matrix_normalized_sharpness",
          "normalized_sharpness", "normalized_sharpness_nce", "normalized_sharpness:published",
          "scale_invariant_rangamani"]
"""The measures over a selection of the parameters: they report `left_out`."""
NORMS = ["frobenius_norm", "frobenius_norm_product", "spectral_norm"]
"""... of which these read the weights only: a parameter is named iff scaling it leaves the value alone."""
WHOLE = ["relative_flatness", "relative_flatness_normalized", "fisher_rao_norm", "eps_sharpness",
         "adaptive_sharpness_avg"]
"""Measures whose value every parameter enters (perturbed, or through the features and logits)."""
NOT_APPLICABLE = ["path_norm", "psi_flatness", "psi_path_ratio", "minimum_sharpness"]
SETTINGS = {"spectral_norm": {"iters": 3000, "tol": 1e-13},
            "normalized_sharpness": {"published_steps": 200},
            "scale_invariant_rangamani": {"tol": 1e-10, "max_iter": 300},
            "eps_sharpness": {"iters": 3}, "adaptive_sharpness_avg": {"samples": 3}}


def _measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, names: list[str]):
    df = flatbench.measure(model, (x, y), names, settings=SETTINGS)
    values = {r.key: r.value for r in df.itertuples() if r.key in names}
    statuses = {r.key: r.status for r in df.itertuples() if r.key in names}
    return values, statuses, df.attrs["info"]


@pytest.fixture(scope="module")
def transformer():
    model, x, y = _model_and_data()
    return model, x, y, _measure(model, x, y, SUBSET + WHOLE + NOT_APPLICABLE)


def test_every_parameter_is_covered_or_named(transformer):
    """Scale each parameter by 2 in turn: every measure's value changes, or its `info.left_out` names the
    parameter; for the norms (which read only the weights) a parameter is named exactly when the value stays."""
    model, x, y, (base, statuses, info) = transformer
    assert all(statuses[n] == "ok" for n in SUBSET + WHOLE), statuses
    assert all(statuses[n] == "not_applicable" for n in NOT_APPLICABLE), statuses
    params = [n for n, _ in model.named_parameters()]
    named = {}
    for name in SUBSET:
        groups = info[name]["left_out"]
        flat = [p for group in groups.values() for p in group]
        assert len(flat) == len(set(flat)) and set(flat) <= set(params), (name, groups)
        named[name] = set(flat)
    for name in WHOLE:
        assert "left_out" not in info[name]
        named[name] = set()
    silent = []
    for param in params:
        scaled = copy.deepcopy(model)
        with torch.no_grad():
            dict(scaled.named_parameters())[param].mul_(2.0)
        values, statuses, _ = _measure(scaled, x, y, SUBSET + WHOLE)
        for name in SUBSET + WHOLE:
            changed = abs(values[name] - base[name]) > 1e-9 * abs(base[name])
            if not changed and param not in named[name]:
                silent.append((name, param))
            if name in NORMS:
                assert changed == (param not in named[name]), (name, param, values[name], base[name])
    assert not silent, f"left out without being named: {silent}"


def test_frobenius_norm_is_the_sum_of_squares_over_exactly_the_documented_matrices(transformer):
    model, x, y, (values, _, info) = transformer
    params = dict(model.named_parameters())
    squares = {n: math.fsum(v * v for v in params[n].detach().flatten().tolist()) for n in MATRICES}
    assert values["frobenius_norm"] == pytest.approx(math.fsum(squares.values()), rel=1e-13)
    assert info["frobenius_norm"]["left_out"] == LEFT_OUT
    w = params["attn.in_proj_weight"].detach()
    blocks = {f"attn.in_proj_weight.{p}": w[i * DIM:(i + 1) * DIM] for i, p in enumerate("qkv")}
    matrices = {"emb": params["emb.weight"], "mix": params["mix.weight"], **blocks,
                "attn.out_proj": params["attn.out_proj.weight"], "head": params["head.weight"]}
    df = flatbench.measure(model, (x, y), ["frobenius_norm", "frobenius_norm_product", "spectral_norm"],
                           settings=SETTINGS)
    details = {r.key: r.value for r in df.itertuples()}
    logs = 0.0
    for key, m in matrices.items():
        sq = math.fsum(v * v for v in m.detach().flatten().tolist())
        assert details[f"frobenius_norm/{key}"] == pytest.approx(sq, rel=1e-13), key
        logs += math.log(sq)
    assert set(k for k in details if k.startswith("frobenius_norm/")) == {f"frobenius_norm/{k}" for k in matrices}
    assert details["frobenius_norm_product"] == pytest.approx(logs, rel=1e-12)
    # spectral: the matrices by SVD (q, k, v each its own), the Conv1d as its operator on (DIM, LENGTH)
    conv = model.mix
    basis = torch.eye(DIM * LENGTH, dtype=torch.float64).reshape(-1, DIM, LENGTH)
    operator = nn.functional.conv1d(basis, conv.weight.detach(), None, padding=1).reshape(DIM * LENGTH, -1).t()
    expected = {k: float(torch.linalg.matrix_norm(m.detach(), 2)) ** 2 for k, m in matrices.items() if k != "mix"}
    expected["mix"] = float(torch.linalg.matrix_norm(operator, 2)) ** 2
    for key, value in expected.items():
        assert details[f"spectral_norm/{key}"] == pytest.approx(value, rel=1e-9), key
    assert details["spectral_norm"] == pytest.approx(math.fsum(math.log(v) for v in expected.values()), rel=1e-9)
    assert info["spectral_norm"]["left_out"] == LEFT_OUT


def test_the_measures_over_the_matrices_name_the_same_parameters(transformer):
    _, _, _, (_, _, info) = transformer
    for name in SUBSET:
        assert info[name]["left_out"] == LEFT_OUT, name


def test_the_relative_flatness_layer_is_the_head_not_the_attention_out_proj(transformer):
    _, _, _, (_, _, info) = transformer
    assert info["relative_flatness"]["layer"] == "head"


def _attention_rescaled(model: nn.Module, per_row: bool) -> nn.Module:
    """The attention's own function-preserving rescalings: query row i × a_i with key row i ÷ a_i (their
    biases alike), value row i × b_i with the output projection's column i ÷ b_i; one a and one b for the
    whole block unless `per_row`."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    size = DIM if per_row else 1
    a, b = (torch.exp(2 * torch.rand(size, generator=gen, dtype=torch.float64) - 1) * 3 for _ in range(2))
    attn = out.attn
    with torch.no_grad():
        w, bias = attn.in_proj_weight, attn.in_proj_bias
        for rows, factor in ((slice(0, DIM), a), (slice(DIM, 2 * DIM), 1 / a), (slice(2 * DIM, 3 * DIM), b)):
            w[rows] *= factor[:, None]
            bias[rows] *= factor
        attn.out_proj.weight /= b[None, :]
    return out


@pytest.mark.parametrize("per_row", [False, True])
def test_the_attention_symmetries_leave_the_normalized_measures_unchanged(transformer, per_row):
    """What normalized.py's docstring claims for the attention's matrices: normalized sharpness is unchanged by
    the row rescalings, matrix-normalized sharpness and Rangamani's metric by the whole-block ones (and the
    per-row rescalings do change matrix-normalized sharpness: the check can fail)."""
    model, x, y, (base, _, _) = transformer
    rescaled = _attention_rescaled(model, per_row)
    with torch.no_grad():
        assert torch.allclose(rescaled(x), model(x), rtol=0, atol=1e-12)
    names = ["normalized_sharpness", "normalized_sharpness_nce", "matrix_normalized_sharpness",
             "scale_invariant_rangamani", "frobenius_norm"]
    values, _, _ = _measure(rescaled, x, y, names)
    assert values["normalized_sharpness"] == pytest.approx(base["normalized_sharpness"], rel=1e-8)
    assert values["normalized_sharpness_nce"] == pytest.approx(base["normalized_sharpness_nce"], rel=1e-8)
    assert values["frobenius_norm"] != pytest.approx(base["frobenius_norm"], rel=1e-3)
    if per_row:
        assert values["matrix_normalized_sharpness"] != pytest.approx(base["matrix_normalized_sharpness"], rel=1e-3)
    else:
        assert values["matrix_normalized_sharpness"] == pytest.approx(base["matrix_normalized_sharpness"], rel=1e-10)
        assert values["scale_invariant_rangamani"] == pytest.approx(base["scale_invariant_rangamani"], rel=1e-7)


class _CallsOutProj(nn.Module):
    """An attention whose output projection is called again by the model, a head tied to the embedding, an
    attention with separate q/k/v projections (kdim ≠ embed_dim), a transformer encoder layer (whose
    inference fast path calls none of its submodules), an LSTM and a layer that is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(DIM, 2, kdim=3, vdim=3, batch_first=True, bias=False)
        self.keys = nn.Linear(DIM, 3, bias=False)
        self.enc = nn.TransformerEncoderLayer(DIM, 2, 8, dropout=0.0, batch_first=True)
        self.lstm = nn.LSTM(DIM, DIM, batch_first=True)
        self.unused = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.emb(tokens)
        t = t + self.attn.out_proj(self.attn(t, t, t, need_weights=False)[0])
        k = self.keys(t)
        t = t + self.cross(t, k, k, need_weights=False)[0]
        t, _ = self.lstm(self.enc(t))
        return self.out(t.mean(dim=1))


@pytest.mark.parametrize("grad", [True, False])
def test_each_matrix_once_and_what_is_left_out(grad):
    """A parameter is one matrix however often it is used (the out_proj called again, the tied head); the
    encoder layer's matrices are found with or without gradients (torch leaves its inference fast path, which
    calls no submodule, while hooks are attached); recurrent weights and a layer the forward pass does not call
    are named `other`."""
    torch.manual_seed(0)
    model = _CallsOutProj().double().eval().requires_grad_(grad)
    tokens = torch.randint(0, VOCAB, (1, LENGTH))
    matrices = weight_matrices(model, tokens)
    assert [m.name for m in matrices] == [
        "emb", "attn.in_proj_weight.q", "attn.in_proj_weight.k", "attn.in_proj_weight.v", "attn.out_proj", "keys",
        "cross.q_proj_weight", "cross.k_proj_weight", "cross.v_proj_weight", "cross.out_proj",
        "enc.self_attn.in_proj_weight.q", "enc.self_attn.in_proj_weight.k", "enc.self_attn.in_proj_weight.v",
        "enc.self_attn.out_proj", "enc.linear1", "enc.linear2"]
    params = dict(model.named_parameters())
    assert all(m.weight.shape == (DIM, 3 if m.name in ("cross.k_proj_weight", "cross.v_proj_weight") else DIM)
               for m in matrices if m.name.startswith(("attn", "cross", "enc.self_attn")))
    ctx = flatbench.MeasureContext(model=model, inputs=tokens.repeat(2, 1), targets=torch.zeros(2, dtype=torch.long),
                                   num_classes=VOCAB)
    out = flatbench.measures.all_measures()["frobenius_norm"].fn(ctx)
    once = {id(m.parameter): m.parameter for m in matrices}.values()
    assert out.values["frobenius_norm"] == pytest.approx(math.fsum(float(p.detach().pow(2).sum()) for p in once),
                                                         rel=1e-13)
    assert out.info["left_out"] == {
        "biases": ["attn.in_proj_bias", "attn.out_proj.bias", "enc.self_attn.in_proj_bias",
                   "enc.self_attn.out_proj.bias", "enc.linear1.bias", "enc.linear2.bias", "lstm.bias_ih_l0",
                   "lstm.bias_hh_l0", "unused.bias"],
        "normalization": ["enc.norm1.weight", "enc.norm1.bias", "enc.norm2.weight", "enc.norm2.bias"],
        "other": ["lstm.weight_ih_l0", "lstm.weight_hh_l0", "unused.weight"]}
    assert set(params) == {m.param for m in matrices} | {p for g in out.info["left_out"].values() for p in g}


def test_spectral_norm_of_transposed_and_3d_convolutions_is_their_operator_norm():
    """ConvTranspose1d (stride 2, output padding) and Conv3d by power iteration against their explicit
    operator matrices on the layers' input shapes."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Unflatten(1, (2, 3)), nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1),
                          nn.Unflatten(1, (1, 3)), nn.Unflatten(3, (8, 1)), nn.Conv3d(1, 2, (2, 2, 1)), nn.Flatten(),
                          nn.LazyLinear(3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    model(x)
    tconv, conv3 = model[1], model[4]
    ops = {"1": (lambda b: nn.functional.conv_transpose1d(b, tconv.weight.detach(), None, 2, 0, 1), (2, 3)),
           "4": (lambda b: nn.functional.conv3d(b, conv3.weight.detach()), (1, 3, 8, 1))}
    df = flatbench.measure(model, (x, torch.arange(4) % 3), ["spectral_norm"],
                           settings={"spectral_norm": {"iters": 5000, "tol": 1e-14}})
    values = {r.key: r.value for r in df.itertuples()}
    for key, (op, shape) in ops.items():
        n = math.prod(shape)
        matrix = op(torch.eye(n, dtype=torch.float64).reshape(n, *shape)).reshape(n, -1).t()
        assert values[f"spectral_norm/{key}"] == pytest.approx(float(torch.linalg.matrix_norm(matrix, 2)) ** 2,
                                                               rel=1e-9), key
    assert df.attrs["info"]["spectral_norm"]["left_out"] == {"biases": ["1.bias", "4.bias", "6.bias"]}


# ---------------------------------------------------------------- the committed studies' architectures


def _bn_params(model: nn.Module) -> set[str]:
    return {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for p, _ in m.named_parameters(recurse=False)}


def _weight_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


@pytest.mark.parametrize("name", CASES)
def test_the_catalogue_selects_the_linear_and_conv2d_layers_as_before(name):
    """On the committed studies' architectures the weight matrices are exactly the Linear/Conv2d layers the
    measures used before (`weight_layers`, same order: the same computation, so the same values), and
    nothing but biases and BatchNorm parameters is left out."""
    ctx = context(name)
    model = case(name).model
    assert [(m.name, m.param, m.rows, m.module) for m in shared.matrices(ctx)] == \
        [(l.name, f"{l.name}.weight", None, l.module) for l in shared.layers(ctx)]
    assert {l.name for l in shared.layers(ctx)} == set(_weight_modules(model))
    left = shared.left_out(ctx)
    assert "other" not in left
    bn = _bn_params(model)
    assert set(left.get("normalization", [])) == bn
    assert set(left.get("biases", [])) == {n for n, _ in model.named_parameters() if n.endswith("bias")} - bn


def _conv_operator_norm_sq(conv: nn.Conv2d, shape: tuple[int, ...]) -> float:
    """‖C‖₂² of the convolution operator on inputs of `shape`, from its explicit matrix (one column per input
    basis vector)."""
    n = math.prod(shape)
    basis = torch.eye(n, dtype=torch.float64).reshape(n, *shape)
    cols = nn.functional.conv2d(basis, conv.weight.detach(), None, conv.stride, conv.padding, conv.dilation,
                                conv.groups)
    return float(torch.linalg.matrix_norm(cols.reshape(n, -1).t(), 2)) ** 2


def _input_shapes(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, ...]]:
    shapes, handles = {}, []

    def record(name: str):
        def hook(_module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
            shapes.setdefault(name, tuple(args[0].shape[1:]))
        return hook

    for n, m in _weight_modules(model).items():
        handles.append(m.register_forward_hook(record(n)))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return shapes


@pytest.mark.parametrize("name", CASES)
def test_the_catalogue_values_equal_brute_force(name):
    """frobenius_norm(_product), spectral_norm, matrix-normalized and normalized sharpness on each catalogue
    case against computations that enumerate the Linear/Conv2d modules themselves."""
    c = case(name)
    modules = _weight_modules(c.model)
    spec = flatbench.measures.all_measures()
    run = lambda measure, **s: spec[measure].fn(context(name).for_measure(measure, {**spec[measure].defaults, **s}))
    squares = {n: math.fsum(v * v for v in m.weight.detach().flatten().tolist()) for n, m in modules.items()}
    assert run("frobenius_norm").values["frobenius_norm"] == pytest.approx(math.fsum(squares.values()), rel=1e-12)
    assert run("frobenius_norm_product").values["frobenius_norm_product"] == pytest.approx(
        math.fsum(math.log(s) for s in squares.values()), rel=1e-12)
    shapes = _input_shapes(c.model, c.inputs[:1])
    spectral = {n: (float(torch.linalg.matrix_norm(m.weight.detach(), 2)) ** 2 if isinstance(m, nn.Linear)
                    else _conv_operator_norm_sq(m, shapes[n])) for n, m in modules.items()}
    out = run("spectral_norm", iters=3000, tol=1e-13)
    for n, value in spectral.items():
        got = out.values[f"spectral_norm/{n}"]
        if isinstance(modules[n], nn.Conv2d):  # power iteration: a lower bound, slow where the top gap is tiny
            assert value * (1 - 1e-4) <= got <= value * (1 + 1e-12), n  # (WRN's blocks.0.conv1: 1.5e-5 short)
        else:
            assert got == pytest.approx(value, rel=1e-12), n
    diag = shared.hessian_diagonal(context(name)).diag
    h = {n: diag[f"{n}.weight"].clamp_min(0) for n in modules}
    mns = math.fsum(2 * math.sqrt(squares[n]) * math.sqrt(float(h[n].sum())) for n in modules)
    assert run("matrix_normalized_sharpness").values["matrix_normalized_sharpness"] == pytest.approx(mns, rel=1e-12)
    ns = math.fsum(solve_normalized_sharpness(*reduce_layer(h[n], m.weight)).value for n, m in modules.items())
    assert run("normalized_sharpness").values["normalized_sharpness"] == pytest.approx(ns, rel=1e-12)


def test_rangamani_on_a_catalogue_case_equals_the_dense_scaled_hessian():
    """λ_max(D^½ H D^½)/(2 + 2L) over the weights of the bias-free MLP, from the full Hessian."""
    c = case("mlp_psi")
    names = [f"{n}.weight" for n in _weight_modules(c.model)]
    full = dense_hessian(c.model, c.inputs, c.targets, nn.functional.cross_entropy)
    params = dict(c.model.named_parameters())
    offsets, at = {}, 0
    for n, p in params.items():
        offsets[n] = (at, at + p.numel())
        at += p.numel()
    index = torch.cat([torch.arange(*offsets[n]) for n in names])
    scale = torch.cat([params[n].detach().norm().expand(params[n].numel()) for n in names])
    block = full[index][:, index] * scale[:, None] * scale[None, :]
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(c.model(c.inputs), c.targets))
    expected = float(torch.linalg.eigvalsh(block)[-1]) / (2 + 2 * loss)
    spec = flatbench.measures.all_measures()["scale_invariant_rangamani"]
    out = spec.fn(context("mlp_psi").for_measure("scale_invariant_rangamani",
                                                  {**spec.defaults, "tol": 1e-10, "max_iter": 300}))
    assert out.values["scale_invariant_rangamani"] == pytest.approx(expected, rel=1e-8)
    assert out.info["left_out"] == {}
