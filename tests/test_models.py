"""flatbench.models: shapes, exact parameter counts, options, determinism and inspectable structure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbench.config import ModelConfig
from flatbench.errors import ConfigError
from flatbench.models import MODELS, build_model, register_model

SHAPES = [(1, 28, 28), (3, 32, 32)]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def weight_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["mlp", "lenet", "wrn"])
def test_output_shape(name: str, shape: tuple[int, int, int]) -> None:
    cfg = ModelConfig(name=name, depth=10, width=1) if name == "wrn" else ModelConfig(name=name)
    model = build_model(cfg, shape, 10)
    for batch in (1, 3):
        model.eval()
        assert model(torch.randn(batch, *shape)).shape == (batch, 10)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("widths", [(512, 512), (100,), (64, 32, 16)])
def test_mlp_param_count(shape: tuple[int, int, int], widths: tuple[int, ...]) -> None:
    d = shape[0] * shape[1] * shape[2]
    dims = [d, *widths, 10]
    expected = sum(linear(a, b) for a, b in zip(dims, dims[1:]))
    assert n_params(build_model(ModelConfig(name="mlp", widths=widths), shape, 10)) == expected
    if widths == (512, 512) and shape == (1, 28, 28):
        assert expected == 669_706


def test_mlp_structure_bias_and_batchnorm() -> None:
    plain = build_model(ModelConfig(name="mlp", widths=(64, 32), bias=False), (1, 28, 28), 10)
    assert not any("bias" in name for name, _ in plain.named_parameters())
    assert n_params(plain) == 784 * 64 + 64 * 32 + 32 * 10
    assert [m.weight.shape for m in weight_layers(plain)] == [(64, 784), (32, 64), (10, 32)]

    bn = build_model(ModelConfig(name="mlp", widths=(64, 32), batch_norm=True), (1, 28, 28), 10)
    kinds = [type(m) for m in bn]
    assert kinds == [nn.Flatten, nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear, nn.BatchNorm1d, nn.ReLU,
                     nn.Linear]
    assert n_params(bn) == linear(784, 64) + linear(64, 32) + linear(32, 10) + 2 * (64 + 32)
    bn.train()
    assert bn(torch.randn(4, 1, 28, 28)).shape == (4, 10)


@pytest.mark.parametrize("shape,expected", [((1, 28, 28), 61_706), ((3, 32, 32), 62_006)])
def test_lenet_param_count(shape: tuple[int, int, int], expected: int) -> None:
    c = shape[0]
    by_hand = (c * 6 * 25 + 6) + (6 * 16 * 25 + 16) + linear(400, 120) + linear(120, 84) + linear(84, 10)
    model = build_model(ModelConfig(name="lenet"), shape, 10)
    assert n_params(model) == by_hand == expected
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs[0].padding == ((2, 2) if shape[1] == 28 else (0, 0))


@pytest.mark.parametrize("shape", SHAPES)
def test_wrn_16_4_param_count(shape: tuple[int, int, int]) -> None:
    model = build_model(ModelConfig(name="wrn"), shape, 10)  # the default is WRN-16-4
    assert 2_700_000 <= n_params(model) <= 2_800_000
    assert n_params(model) == 2_748_890 - 16 * 9 * (3 - shape[0])  # only the stem sees the channels
    model.eval()
    assert model(torch.randn(2, *shape)).shape == (2, 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # stem + 2 blocks × 3 groups × 2 convs + the 3 shortcut convs where the shape changes (16→64 too)
    assert len(convs) == 1 + 12 + 3
    assert [m for m in model.modules() if isinstance(m, nn.Linear)][0].in_features == 256


def test_wrn_one_channel_dropout_and_depth() -> None:
    model = build_model(ModelConfig(name="wrn", depth=10, width=2, dropout=0.3), (1, 28, 28), 10)
    assert any(isinstance(m, nn.Dropout) and m.p == 0.3 for m in model.modules())
    model.train()
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError, match="6k\\+4"):
        build_model(ModelConfig(name="wrn", depth=12), (3, 32, 32), 10)


@pytest.mark.parametrize("name", ["mlp", "lenet", "wrn"])
def test_build_is_deterministic_given_the_global_seed(name: str) -> None:
    cfg = ModelConfig(name=name, depth=10, width=1)
    torch.manual_seed(7)
    a = build_model(cfg, (1, 28, 28), 10).state_dict()
    torch.manual_seed(7)
    b = build_model(cfg, (1, 28, 28), 10).state_dict()
    torch.manual_seed(8)
    c = build_model(cfg, (1, 28, 28), 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_registry() -> None:
    assert {"mlp", "lenet", "wrn"} <= set(MODELS)
    with pytest.raises(ConfigError, match="available"):
        build_model(ModelConfig(name="resnet50"), (3, 32, 32), 10)
    with pytest.raises(ValueError, match="already registered"):
        register_model("mlp")(MODELS["mlp"])


def test_mlp_and_lenet_compute_what_they_say() -> None:
    """The forward passes by hand (the shape tests above check only shapes): MLP = Linear/ReLU chain on the
    flattened input, LeNet-5 = padded conv → ReLU → max-pool twice, then three Linear layers."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    mlp = build_model(ModelConfig(name="mlp", widths=(7, 5)), (1, 28, 28), 10).double().eval()
    lin = weight_layers(mlp)
    h = x.flatten(1)
    for layer in lin[:-1]:
        h = torch.relu(h @ layer.weight.T + layer.bias)
    torch.testing.assert_close(mlp(x), h @ lin[-1].weight.T + lin[-1].bias, rtol=1e-12, atol=1e-12)

    lenet = build_model(ModelConfig(name="lenet"), (1, 28, 28), 10).double().eval()
    c1, c2, f1, f2, f3 = weight_layers(lenet)
    h = F.max_pool2d(torch.relu(F.conv2d(x, c1.weight, c1.bias, padding=2)), 2)
    h = F.max_pool2d(torch.relu(F.conv2d(h, c2.weight, c2.bias)), 2).flatten(1)
    h = torch.relu(F.linear(torch.relu(F.linear(h, f1.weight, f1.bias)), f2.weight, f2.bias))
    torch.testing.assert_close(lenet(x), F.linear(h, f3.weight, f3.bias), rtol=1e-12, atol=1e-12)


def test_wrn_block_is_pre_activation_with_the_documented_shortcut() -> None:
    """One WRN block by hand: BN-ReLU-conv(stride)-BN-ReLU-conv plus a 1×1 conv of the pre-activated input
    where the shape changes, the raw input where it does not; global average pooling before the classifier."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model(ModelConfig(name="wrn", depth=10, width=1), (1, 8, 8), 10).double().eval()
    with torch.no_grad():  # running statistics away from 0 / 1, so BatchNorm is not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)

    def bn(m: nn.BatchNorm2d, h: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, 1, 1)
        return ((h - m.running_mean.view(shape)) / torch.sqrt(m.running_var.view(shape) + m.eps)
                * m.weight.view(shape) + m.bias.view(shape))

    h = F.conv2d(x, model.stem.weight, padding=1)
    for block in model.blocks:
        act = torch.relu(bn(block.bn1, h))
        out = F.conv2d(act, block.conv1.weight, stride=block.conv1.stride, padding=1)
        out = F.conv2d(torch.relu(bn(block.bn2, out)), block.conv2.weight, padding=1)
        skip = h if block.shortcut is None else F.conv2d(act, block.shortcut.weight, stride=block.shortcut.stride)
        h = out + skip
    logits = F.linear(torch.relu(bn(model.bn, h)).mean(dim=(2, 3)), model.fc.weight, model.fc.bias)
    assert [b.shortcut is None for b in model.blocks] == [True, False, False]
    torch.testing.assert_close(model(x), logits, rtol=1e-12, atol=1e-12)


def test_mlp_dropout_is_measured_as_the_same_chain_without_it() -> None:
    """An MLP with dropout (the natural study's axis) has a Dropout after each hidden ReLU in training; every
    measure of the quickstart sees it in eval mode, where it is the identity, so each value equals that of
    the same weights in the chain without dropout."""
    import yaml

    from flatbench import measure
    from flatbench.data import load_dataset
    from flatbench.config import DataConfig

    with_dropout = build_model(ModelConfig(name="mlp", widths=(24, 16), dropout=0.5), (1, 28, 28), 10)
    assert sum(isinstance(m, nn.Dropout) for m in with_dropout) == 2
    plain = build_model(ModelConfig(name="mlp", widths=(24, 16)), (1, 28, 28), 10)
    with torch.no_grad():  # the same weights, in the same order (dropout has none)
        for p, q in zip(plain.parameters(), with_dropout.parameters(), strict=True):
            p.copy_(q)
    ds = load_dataset(DataConfig(dataset="mnist_mini", n_train=40, n_test=10), seed=0)
    quickstart = yaml.safe_load(open("configs/quickstart.yaml"))["measure"]["measures"]
    a = measure(with_dropout.double(), (ds.x_train, ds.y_train), quickstart).set_index("key")
    b = measure(plain.double(), (ds.x_train, ds.y_train), quickstart).set_index("key")
    assert list(a["status"]) == list(b["status"]) and (a["status"] == "ok").sum() >= 15, a["status"]
    ok = (a["status"] == "ok").to_numpy()
    torch.testing.assert_close(torch.tensor(a["value"].to_numpy()[ok]), torch.tensor(b["value"].to_numpy()[ok]),
                               rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("cfg", [ModelConfig(name="mlp", widths=(6, 5)), ModelConfig(name="mlp", widths=()),
                                 ModelConfig(name="mlp", widths=(6,), batch_norm=True, bias=False),
                                 ModelConfig(name="lenet"), ModelConfig(name="wrn", depth=10, width=1)],
                         ids=["mlp", "mlp_linear", "mlp_bn", "lenet", "wrn"])
def test_a_model_declares_at_registration_the_families_and_vectorizing_that_hold(cfg) -> None:
    """Issue 43: `register_model` carries what is known of a model without building it; built, the model
    agrees (`rescale.applicable_families`), and what the contract's catalogue and the vectorized trainer
    read is that declaration."""
    from flatbench import rescale
    from flatbench.models import model_families, model_vectorizable

    model = build_model(cfg, (1, 28, 28) if cfg.name != "wrn" else (3, 8, 8), 10)
    built = {f for f, ok in rescale.applicable_families(model).items() if ok is True}
    assert model_families(cfg) == built, (cfg.name, built)
    has_state = any(isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.Dropout))
                    for m in model.modules())
    assert not (model_vectorizable(cfg) and has_state)
    assert model_families(ModelConfig(name="models.py:build")) == frozenset()
    assert not model_vectorizable(ModelConfig(name="models.py:build"))
