"""Issue 41's rough edges: the HVP mode from `measure-model` and a study's config, integer token inputs kept
as integers, regression targets with `loss="mse"`, dict batches through `batch_fn`, `hessian_max_eig`'s
residuals under names that say what they are (the density's interval: tests/curvature/test_density.py)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import in_process
from torch import nn

import flatbench
from flatbench.errors import FlatbenchError

PROBE = '''
from flatbench import MeasureOutput, register_measure
from flatbench.curvature import HVP_MODES, hvp_mode_of


@register_measure("hvp_mode_probe", description="which HVP mode the measured model's products use")
def hvp_mode_probe(ctx):
    mode = hvp_mode_of(ctx.model)
    return MeasureOutput({"hvp_mode_probe": float(HVP_MODES.index(mode))}, {"hvp_mode": mode})
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """The probe plugin, one file for the module (a measure's name is registered once per process)."""
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


def _one_line(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(FlatbenchError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- 1. the HVP mode


def test_a_study_configs_hvp_mode_override_reaches_the_measured_model(tmp_path, write_config, probe) -> None:
    """`flatbench run CONFIG measure.hvp_mode=double_backward`: the model every measure sees makes its HVPs
    in that mode (a plugin measure reads it off the model it is given)."""
    cfg = write_config({"train": {"epochs": 1},
                        "measure": {"measures": ["hvp_mode_probe"], "plugins": [str(probe)],
                                    "n_examples": 50}})
    run = in_process("run", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--quiet",
                     "measure.hvp_mode=double_backward")
    assert run.returncode == 0, run.stdout + run.stderr
    entries = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("measures.json")]
    assert len(entries) == 3 and {e["hvp_mode_probe"]["info"]["hvp_mode"] for e in entries} == {"double_backward"}


@pytest.fixture()
def blobs(tmp_path: Path) -> Path:
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        from torch import nn

        def build(input_shape, num_classes):
            return nn.Sequential(nn.Linear(input_shape[0], 5), nn.Tanh(), nn.Linear(5, num_classes))
        '''))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 40)
    x = (rng.normal(size=(3, 4))[y] + rng.normal(size=(40, 4))).astype(np.float32)
    np.savez(tmp_path / "blobs.npz", x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    return tmp_path


def test_measure_model_takes_the_hvp_mode(blobs, probe) -> None:
    base = ("measure-model", f"{blobs / 'mine.py'}:build", "--data", str(blobs / "blobs.npz"), "--measures",
            "hvp_mode_probe", "--plugin", str(probe))
    for mode in ("double_backward", "fwd_rev"):
        run = in_process(*base, "--hvp-mode", mode, "--out", str(blobs / mode))
        assert run.returncode == 0, run.stdout + run.stderr
        entry = json.loads((blobs / mode / "measures.json").read_text())["hvp_mode_probe"]
        assert entry["info"]["hvp_mode"] == mode and entry["context"]["hvp_mode"] == mode
    wrong = in_process(*base, "--hvp-mode", "fastest")
    assert wrong.returncode == 2 and "--hvp-mode" in wrong.stderr and "double_backward" in wrong.stderr
    refused = in_process(*base, "--set", "hvp_mode=double_backward")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: ") and "give it as --hvp-mode double_backward" in line


def test_the_api_passes_the_hvp_mode_to_the_measured_model(blobs, probe) -> None:
    from flatbench.api import measure_model

    df, _ = measure_model(f"{blobs / 'mine.py'}:build", str(blobs / "blobs.npz"), measures=["hvp_mode_probe"],
                          plugins=[str(probe)], hvp_mode="double_backward")
    assert df.attrs["info"]["hvp_mode_probe"]["hvp_mode"] == "double_backward"
    model = nn.Sequential(nn.Linear(4, 3))
    data = (torch.randn(6, 4), torch.arange(6) % 3)
    df = flatbench.measure(model, data, ["hvp_mode_probe"], hvp_mode="fwd_rev")
    assert df.attrs["info"]["hvp_mode_probe"]["hvp_mode"] == "fwd_rev"


# ---------------------------------------------------------------- 6. Lanczos residuals


from cases import small_data as _data, small_tanh_mlp as _mlp  # noqa: E402


def test_hessian_max_eig_names_its_relative_and_absolute_residuals() -> None:
    """info["relative_residual"] is ‖Hy − θy‖ / |θ|, the number the not_converged reason gives;
    info["absolute_residual"] is ‖Hy − θy‖ itself (no bare "residual" whose meaning one would guess)."""
    x, y = _data()
    df = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"],
                           settings={"hessian_max_eig": {"iters": 2, "k": 2, "per": "layer"}})
    row, info = df.iloc[0], df.attrs["info"]["hessian_max_eig"]
    assert row["status"] == "not_converged"
    assert "residual" not in info and "residuals" not in info
    top = info["values"]["hessian_max_eig"]
    assert info["relative_residual"] == pytest.approx(info["absolute_residual"] / abs(top), rel=1e-12)
    assert info["relative_residuals"] == pytest.approx([a / abs(v) for a, v in zip(info["absolute_residuals"],
                                                                                   info["eigenvalues"])], rel=1e-12)
    rule = max(info["absolute_residuals"]) / max(abs(v) for v in info["eigenvalues"])  # k = 2: the stopping rule's
    assert f"on H stopped at iters = 2 with relative residual {rule:.3g} >" in row["reason"]
    for name, block in info["per_layer"].items():
        assert "residual" not in block
        assert block["relative_residual"] == pytest.approx(block["absolute_residual"] / abs(block["eigenvalue"]))
        if not block["converged"]:
            assert f"layer {name} stopped at iters = 2 with relative residual {block['relative_residual']:.3g}" \
                in row["reason"]
    one = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"], settings={"hessian_max_eig": {"iters": 2}})
    info = one.attrs["info"]["hessian_max_eig"]
    assert f"relative residual {info['relative_residual']:.3g} > tol" in one.iloc[0]["reason"]
    done = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"], settings={"hessian_max_eig": {"tol": 1e-8}})
    info = done.attrs["info"]["hessian_max_eig"]
    assert done.iloc[0]["status"] == "ok" and info["relative_residual"] <= 1e-8 and info["converged"]


# ---------------------------------------------------------------- 2. integer token inputs

BAG = '''
from torch import nn


class Bag(nn.Module):
    """Token ids -> embedding -> mean over the sequence -> linear."""

    def __init__(self, vocab, dim, out):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, out)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def build(input_shape, num_classes, vocab=12):
    return Bag(vocab, 4, num_classes)
'''


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """An .npz of int64 token ids (vocabulary 12, length 5) with labels 0..2, and the Bag factory."""
    where = tmp_path_factory.mktemp("tokens")
    (where / "bag.py").write_text(BAG)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, (90, 5))
    y = x[:, 0] % 3
    np.savez(where / "tokens.npz", x_train=x[:60], y_train=y[:60], x_test=x[60:], y_test=y[60:])
    return where


def _dense_hessian(net: nn.Module, x: torch.Tensor, loss) -> torch.Tensor:
    """∇²_θ loss(net(x)) by torch.autograd.functional.hessian over the flat parameters (float64): the
    brute-force reference."""
    from torch.func import functional_call

    shapes = [(name, p.shape) for name, p in net.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double()

    def f(theta: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for name, shape in shapes:
            params[name] = theta[start:start + shape.numel()].view(shape)
            start += shape.numel()
        return loss(functional_call(net, params, (x,)))

    return torch.autograd.functional.hessian(f, flat)


def test_npz_inputs_are_read_by_dtype(tmp_path) -> None:
    """uint8: images scaled to [0, 1]; other integer types: int64 token ids; floating point: float32."""
    from flatbench.config import DataConfig
    from flatbench.data import load_dataset

    rng = np.random.default_rng(1)
    y = np.arange(20) % 2
    cases = {"uint8": (rng.integers(0, 256, (20, 3)).astype(np.uint8), torch.float32),
             "int32": (rng.integers(0, 50, (20, 3)).astype(np.int32), torch.int64),
             "uint16": (rng.integers(0, 50, (20, 3)).astype(np.uint16), torch.int64),
             "int64": (rng.integers(0, 50, (20, 3)), torch.int64),
             "float64": (rng.normal(size=(20, 3)), torch.float32)}
    for name, (x, dtype) in cases.items():
        np.savez(tmp_path / f"{name}.npz", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
        ds = load_dataset(DataConfig(dataset=str(tmp_path / f"{name}.npz")), 0)
        assert ds.x_train.dtype == dtype and ds.x_test.dtype == dtype, name
        expected = x / 255.0 if name == "uint8" else x
        assert np.allclose(ds.x_train.numpy(), expected, rtol=1e-6), name
    np.savez(tmp_path / "mixed.npz", x_train=cases["uint8"][0], y_train=y, x_test=cases["int64"][0][:4],
             y_test=y[:4])
    _one_line(r"x_train \(uint8\) and x_test \(int64\) are read differently", load_dataset,
              DataConfig(dataset=str(tmp_path / "mixed.npz")), 0)


def test_measure_model_and_the_api_give_an_embedding_model_integer_tokens(tokens, tmp_path) -> None:
    """The tokens reach the model as integers from `measure-model` and from `flatbench.measure`; the trace
    is the dense Hessian's."""
    out = tmp_path / "out"
    run = in_process("measure-model", f"{tokens / 'bag.py'}:build", "--data", str(tokens / "tokens.npz"),
                     "--measures", "hessian_trace,fisher_rao_norm,hessian_max_eig", "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    entries = json.loads((out / "measures.json").read_text())
    assert {e["status"] for e in entries.values()} == {"ok"}, entries
    from flatbench.models import build_from_factory

    torch.manual_seed(0)  # measure-model's seed 0 builds this very model
    net = build_from_factory(f"{tokens / 'bag.py'}:build", (5,), 3).double()
    with np.load(tokens / "tokens.npz") as z:
        x, y = torch.from_numpy(z["x_train"]), torch.from_numpy(z["y_train"])
    assert x.dtype == torch.int64
    df = flatbench.measure(net, (x, y), ["hessian_trace"])
    assert df.iloc[0]["status"] == "ok"
    exact = float(_dense_hessian(net, x, lambda out: nn.functional.cross_entropy(out, y)).trace())
    assert df.iloc[0]["value"] == pytest.approx(exact, rel=1e-10)
    assert entries["hessian_trace"]["values"]["hessian_trace"] == pytest.approx(exact, rel=1e-10)


def test_a_study_trains_and_measures_on_integer_tokens(tokens, tmp_path, write_config, monkeypatch) -> None:
    """A study of the Bag factory on the token .npz: trained, and measured (hessian_max_eig in its float32
    twin under measure.dtype auto: the tokens stay integers there too)."""
    monkeypatch.chdir(tokens)
    cfg = write_config({"data": {"dataset": "tokens.npz", "random_label_ratio": [0.0, 0.5, 1.0], "n_train": 60,
                                 "n_test": 30},
                        "model": {"name": "bag.py:build"}, "train": {"epochs": 1, "batch_size": 16},
                        "measure": {"measures": ["frobenius_norm", "hessian_max_eig"], "n_examples": 30}})
    run = in_process("run", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--quiet")
    assert run.returncode == 0, run.stdout + run.stderr
    entries = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("measures.json")]
    assert len(entries) == 3 and all(e["hessian_max_eig"]["status"] == "ok" for e in entries)


def test_integer_inputs_to_a_float_network_still_say_what_to_do() -> None:
    x, y = _data()
    text = _one_line("inputs are torch.int64, given to the model as they are.*x.float", flatbench.measure,
                     _mlp(), ((x * 10).long(), y), ["path_norm"])
    assert "nn.Embedding" in text


# ---------------------------------------------------------------- 3. regression targets


def _regression(outputs: int, n: int = 20, act: type = nn.Tanh, bias: bool = True
                ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 5, bias=bias), act(), nn.Linear(5, outputs, bias=bias)).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randn(n, outputs, dtype=torch.float64) if outputs > 1 else torch.randn(n, dtype=torch.float64)
    return net, x, y


@pytest.mark.parametrize("outputs,act", [(2, nn.Tanh), (1, nn.Tanh), (3, nn.ReLU)])
def test_mse_on_regression_targets_is_the_dense_hessians(outputs: int, act: type) -> None:
    """loss="mse" with float targets (n, k) or (n,): the mean over the examples of the squared error's mean
    over the outputs; hessian_trace equals the dense Hessian's trace (float64) to 1e-10 and hessian_max_eig
    its top eigenvalue; the logit Hessian is (2/k) I."""
    from flatbench.losses import get_loss

    net, x, y = _regression(outputs, act=act)
    hess = _dense_hessian(net, x, lambda out: ((out - y.reshape(out.shape)) ** 2).mean())
    df = flatbench.measure(net, (x, y), ["hessian_trace", "hessian_max_eig"], loss="mse",
                           settings={"hessian_max_eig": {"tol": 1e-10, "iters": 200}})
    rows = df.set_index("key")
    assert rows.loc["hessian_trace@mse", "status"] == "ok", rows.loc["hessian_trace@mse", "reason"]
    assert abs(rows.loc["hessian_trace@mse", "value"] - float(hess.trace())) <= 1e-10
    assert rows.loc["hessian_max_eig@mse", "value"] == pytest.approx(float(torch.linalg.eigvalsh(hess).max()),
                                                                    rel=1e-8)
    logits = net(x).detach()
    loss = get_loss("mse")
    assert torch.allclose(loss.per_example(logits, y), ((logits - y.reshape(logits.shape)) ** 2).mean(1))
    assert torch.allclose(loss.logit_hessian(logits, y),
                          (torch.eye(outputs, dtype=torch.float64) * 2 / outputs).expand(len(y), -1, -1))
    classes = torch.arange(20) % outputs  # integer targets: one-hot, as before
    onehot = nn.functional.one_hot(classes, outputs).double()
    assert torch.allclose(loss.per_example(logits, classes), ((logits - onehot) ** 2).mean(1))


def test_classification_measures_are_not_applicable_on_regression_targets() -> None:
    """The PAC-Bayes searches (accuracy drops), the measures defined with ce or normalized_ce: not
    applicable, with the reason; the rest computed with mse. A classification loss asked for with float
    targets, or targets of another width than the outputs: one line before any work."""
    net, x, y = _regression(2, act=nn.ReLU, bias=False)
    names = ["pacbayes_flatness", "pacbayes_mag_flatness", "normalized_sharpness", "normalized_sharpness_nce",
             "fisher_rao_norm", "hessian_trace", "psi_flatness", "relative_flatness", "eps_sharpness",
             "path_norm"]
    df = flatbench.measure(net, (x, y), names, loss="mse", settings={"pacbayes_flatness": {"search_depth": 3}})
    rows = {r["measure"]: r for _, r in df[~df["key"].str.contains("/")].iterrows()}
    for name in ("pacbayes_flatness", "pacbayes_mag_flatness"):
        assert rows[name]["status"] == "not_applicable" and "accuracy" in rows[name]["reason"], rows[name]
        assert "regression targets" in rows[name]["reason"]
    for name, loss in (("normalized_sharpness", "ce"), ("normalized_sharpness_nce", "normalized_ce"),
                       ("fisher_rao_norm", "ce")):
        assert rows[name]["status"] == "not_applicable", rows[name]
        assert f"the loss {loss} needs class-index targets" in rows[name]["reason"]
    for name in ("hessian_trace", "psi_flatness", "relative_flatness", "eps_sharpness", "path_norm"):
        assert rows[name]["status"] == "ok", rows[name]
    for loss in ("ce", "normalized_ce"):
        _one_line(f"regression targets, and the loss {loss} needs class indices: use the loss mse",
                  flatbench.measure, net, (x, y), ["hessian_trace"], loss=loss)
    _one_line(r"regression targets have 3 value\(s\) per example \(20, 3\), the model 2 outputs",
              flatbench.measure, net, (x, torch.randn(20, 3, dtype=torch.float64)), ["hessian_trace"], loss="mse")
    _one_line(r"regression targets, of shape \(n,\) or \(n, k\)", flatbench.measure, net,
              (x, torch.randn(20, 2, 1)), ["hessian_trace"], loss="mse")
    _one_line("NaN or infinite", flatbench.measure, net, (x, torch.full((20, 2), math.nan)), ["hessian_trace"],
              loss="mse")


def test_measure_model_on_regression_npz(tmp_path, write_config) -> None:
    """An .npz with float y_train (N,): measure-model builds the factory with 1 output and measures it with
    --loss mse; without it (ce) one line names --loss mse; a study on it is refused in one line."""
    (tmp_path / "reg.py").write_text(textwrap.dedent('''
        from torch import nn

        def build(input_shape, num_classes):
            assert num_classes == 1
            return nn.Sequential(nn.Linear(input_shape[0], 6), nn.Tanh(), nn.Linear(6, num_classes))
        '''))
    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=50)).astype(np.float64)
    np.savez(tmp_path / "reg.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    base = ("measure-model", f"{tmp_path / 'reg.py'}:build", "--data", str(tmp_path / "reg.npz"), "--measures",
            "hessian_trace,pacbayes_flatness,normalized_sharpness")
    run = in_process(*base, "--loss", "mse", "--n-examples", "30", "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stdout + run.stderr
    entries = json.loads((tmp_path / "out" / "measures.json").read_text())
    assert entries["hessian_trace@mse"]["status"] == "ok" and entries["hessian_trace@mse"]["context"]["n_examples"] == 30
    assert entries["pacbayes_flatness"]["status"] == entries["normalized_sharpness"]["status"] == "not_applicable"
    refused = in_process(*base)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--loss mse" in refused.stderr and refused.stderr.startswith("error: ")
    cfg = write_config({"data": {"dataset": str(tmp_path / "reg.npz"), "random_label_ratio": 0.0, "n_train": 40,
                                 "n_test": 10},
                        "model": {"name": f"{tmp_path / 'reg.py'}:build"}, "measure": {"n_examples": 20}})
    study = in_process("run", str(cfg), "--out", str(tmp_path / "study"), "--device", "cpu")
    assert study.returncode == 2 and len(study.stderr.strip().splitlines()) == 1, study.stderr
    assert "floating-point (regression) targets: a study trains classifiers" in study.stderr


# ---------------------------------------------------------------- 4. batches from a DataLoader


class _Dicts(torch.utils.data.Dataset):
    """A HuggingFace-style dataset: each item a dict of input_ids, attention_mask and labels."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]), "labels": self.y[i]}


class _Lists(torch.utils.data.Dataset):
    """Each item an [inputs, target] list (collated into [inputs, targets] batches)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> list:
        return [self.x[i], self.y[i]]


def test_dict_and_list_batches_from_a_dataloader() -> None:
    from torch.utils.data import DataLoader

    factory: dict = {}
    exec(BAG, factory)  # the Bag of the token tests: dict batches carry token ids
    torch.manual_seed(0)
    net = factory["build"]((5,), 3).double()
    x, y = torch.randint(0, 12, (24, 5)), torch.arange(24) % 3
    whole = flatbench.measure(net, (x, y), ["hessian_trace"]).iloc[0]["value"]
    dicts = DataLoader(_Dicts(x, y), batch_size=7)
    text = _one_line(r"data: batch 1 is a dict \(keys: input_ids, attention_mask, labels\): pass batch_fn",
                     flatbench.measure, net, dicts, ["hessian_trace"])
    assert 'batch_fn=lambda b: (b["input_ids"], b["labels"])' in text
    df = flatbench.measure(net, dicts, ["hessian_trace"], batch_fn=lambda b: (b["input_ids"], b["labels"]))
    assert df.iloc[0]["value"] == pytest.approx(whole, rel=1e-12)
    lists = DataLoader(_Lists(x, y), batch_size=5)
    assert isinstance(next(iter(lists)), list)
    assert flatbench.measure(net, lists, ["hessian_trace"]).iloc[0]["value"] == pytest.approx(whole, rel=1e-12)
    first = flatbench.measure(net, lists, ["hessian_trace"], n_examples=12).iloc[0]["value"]
    assert first == pytest.approx(flatbench.measure(net, (x[:12], y[:12]), ["hessian_trace"]).iloc[0]["value"])
    one = flatbench.measure(net, {"input_ids": x, "labels": y}, ["hessian_trace"],
                            batch_fn=lambda b: (b["input_ids"], b["labels"]))
    assert one.iloc[0]["value"] == pytest.approx(whole, rel=1e-12)
    ragged = [(x[:8], y[:8]), (torch.randint(0, 12, (8, 6)), y[8:16])]
    _one_line(r"batch 2 has inputs of shape \(6,\) torch.int64 per example, batch 1 \(5,\)", flatbench.measure,
              net, ragged, ["hessian_trace"])
    mixed = [(x[:8], y[:8]), (x[8:16], y[8:16].double())]
    _one_line("batch 2 has targets of shape", flatbench.measure, net, mixed, ["hessian_trace"])
    _one_line("batch_fn must return", flatbench.measure, net, dicts, ["hessian_trace"], batch_fn=lambda b: b)
    _one_line("batch_fn failed: KeyError", flatbench.measure, net, dicts, ["hessian_trace"],
              batch_fn=lambda b: (b["ids"], b["labels"]))
    _one_line("batch 1: the inputs are a list", flatbench.measure, net, [([1, 2], y[:2])], ["hessian_trace"])
    _one_line("batch 1: 8 inputs and 7 targets", flatbench.measure, net, [(x[:8], y[:7])], ["hessian_trace"])
    _one_line("batch_fn must be a function", flatbench.measure, net, dicts, ["hessian_trace"], batch_fn="ids")


# ---------------------------------------------------------------- 7-8. the API's docstrings and page


def test_the_api_timeout_default_is_a_studys() -> None:
    import inspect

    from flatbench.api import measure_records
    from flatbench.config import MeasureConfig

    for fn in (flatbench.measure, measure_records):
        assert inspect.signature(fn).parameters["timeout_s"].default == MeasureConfig.timeout_s


def test_measure_records_returns_what_its_docstring_says() -> None:
    from flatbench.api import measure_records

    assert "DataFrame" not in measure_records.__doc__.split("\n")[0] or "instead of a DataFrame" in \
        measure_records.__doc__
    records = measure_records(_mlp(), _data(), ["frobenius_norm"])
    assert isinstance(records, dict) and records["frobenius_norm"]["status"] == "ok"
    assert set(records["frobenius_norm"]) >= {"measure", "status", "values", "info", "settings", "seconds"}
