"""Models by name: mlp, lenet, wrn, or the user's own from a factory (`models.py:build`, `pkg.models:build`).

Module structure is kept plain on purpose: the weight layers (`nn.Linear`, `nn.Conv2d`) appear in
`model.modules()` in forward order, and mlp and lenet are `nn.Sequential`s whose hidden layers are
separated only by ReLU (and max-pooling), both positively homogeneous. That is what the
function-preserving rescalings (`flatbench.rescale`) and the per-layer Hessian computations rely on.

A built-in model is one `@register_model` here, which declares the rescaling families that apply to it and
whether its runs can train as one vectorized group (the contract's catalogue and the trainer read them).

Initialization uses the global torch RNG: `build_model` is deterministic given `torch.manual_seed`, and
the trainer seeds it with `torch.manual_seed(derive_seed(...))` right before building.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

import torch
from torch import Tensor, nn

from flatbench.config import ModelConfig, run_config_from_dict
from flatbench.errors import CheckpointError, ConfigError, FlatbenchError
from flatbench.store import MODEL_FILE, RUN_JSON, check_model_hash, load_run_info, torch_load
from flatbench.userspec import call_with_accepted, is_factory_spec, load_object

ModelBuilder = Callable[[ModelConfig, tuple[int, ...], int], nn.Module]


@dataclass(frozen=True)
class ModelSpec:
    """A built-in model: its builder and what it declares, each a constant or a function of its ModelConfig."""

    build: ModelBuilder
    families: Iterable[str] | Callable[[ModelConfig], Iterable[str]] = ()
    """The rescaling families (`flatbench.rescale.FAMILIES`) that apply to the model it builds
    (tests/test_models.py checks them against `rescale.applicable_families` on the built model)."""
    vectorizable: bool | Callable[[ModelConfig], bool] = False
    """Whether its runs can train as one vectorized group (no batch norm, dropout or buffers)."""


MODELS: dict[str, ModelSpec] = {}
"""Registry: model name → its builder `(cfg, input_shape, num_classes)` and what it declares."""


def register_model(name: str, *, families: Iterable[str] | Callable[[ModelConfig], Iterable[str]] = (),
                   vectorizable: bool | Callable[[ModelConfig], bool] = False,
                   ) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder `(cfg, input_shape, num_classes) -> nn.Module` to `MODELS`, with the
    rescaling families that apply to the model it builds and whether it can be vectorized."""
    def decorate(builder: ModelBuilder) -> ModelBuilder:
        if name in MODELS:
            raise ValueError(f"model '{name}' is already registered")
        MODELS[name] = ModelSpec(builder, families, vectorizable)
        return builder
    return decorate


def model_families(cfg: ModelConfig) -> frozenset[str]:
    """The rescaling families that apply to the model `cfg` builds (none known for a factory's model)."""
    declared = MODELS[cfg.name].families if cfg.name in MODELS else ()
    return frozenset(declared(cfg) if callable(declared) else declared)


def model_vectorizable(cfg: ModelConfig) -> bool:
    """Whether runs of the model `cfg` builds can train as one vectorized group (a factory's model: no)."""
    declared = MODELS[cfg.name].vectorizable if cfg.name in MODELS else False
    return bool(declared(cfg) if callable(declared) else declared)


def check_model_name(name: str) -> None:
    """A built-in model name, or a factory `file.py:function` / `pkg.module:function` that can be loaded;
    one line otherwise."""
    if is_factory_spec(name):
        load_object(name, "model factory")
        return
    if name not in MODELS:
        close = get_close_matches(name, list(MODELS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown model '{name}'{hint} (available: "
                          f"{', '.join(sorted(MODELS))}, or a factory file.py:function / pkg.module:function)")


def build_from_factory(spec: str, input_shape: tuple[int, ...], num_classes: int,
                       kwargs: dict | None = None) -> nn.Module:
    """The user's model: `spec` (file.py:function or pkg.module:function) called with `kwargs` and, where
    its signature takes them, `input_shape` and `num_classes`; it must return an `nn.Module`."""
    fn = load_object(spec, "model factory")
    try:
        model = call_with_accepted(fn, {"input_shape": tuple(input_shape), "num_classes": int(num_classes)},
                                   dict(kwargs or {}), f"model factory '{spec}'")
    except SystemExit as exc:  # sys.exit(0) in a factory must not end the command as a success
        raise FlatbenchError(f"model factory '{spec}' called sys.exit({exc.code!r}) instead of returning a "
                             "model") from None
    except FlatbenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - ValueError, RecursionError, MemoryError, ...: the user's code
        text = str(exc).strip().splitlines()
        raise FlatbenchError(f"model factory '{spec}' raised {type(exc).__name__}"
                             f"{': ' + text[0][:200] if text else ''}") from None
    if not isinstance(model, nn.Module):
        raise FlatbenchError(f"model factory '{spec}' returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build `cfg.name` for inputs of shape (C, H, W) and `num_classes` outputs, using the global RNG;
    a factory (`file.py:function`, `pkg.module:function`) gets `cfg.kwargs`."""
    if is_factory_spec(cfg.name):
        return build_from_factory(cfg.name, input_shape, num_classes, cfg.kwargs)
    if cfg.kwargs:
        raise ConfigError(f"model.kwargs is for model factories (file.py:function); '{cfg.name}' is built in")
    if cfg.name not in MODELS:
        raise ConfigError(f"unknown model '{cfg.name}' (available: {', '.join(sorted(MODELS))})")
    return MODELS[cfg.name].build(cfg, tuple(input_shape), num_classes)


# ---------------------------------------------------------------- mlp


class MLP(nn.Sequential):
    """Flatten → [Linear → (BatchNorm1d) → ReLU → (Dropout)] per hidden width → Linear to the classes.

    Dropout is an identity in eval mode, where every measure is computed: a trained MLP with dropout is
    measured as the same chain without it (tests/test_models.py checks every measure of the quickstart)."""

    def __init__(self, in_features: int, widths: tuple[int, ...], num_classes: int, bias: bool = True,
                 batch_norm: bool = False, dropout: float = 0.0):
        layers: list[nn.Module] = [nn.Flatten()]
        prev = in_features
        for width in widths:
            layers.append(nn.Linear(prev, width, bias=bias))
            if batch_norm:
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            prev = width
        layers.append(nn.Linear(prev, num_classes, bias=bias))
        super().__init__(*layers)


@register_model("mlp", families=lambda cfg: {"logit_scale", *(("layer", "node") if cfg.widths else ()),
                                             *(("bn",) if cfg.batch_norm else ())},
                vectorizable=lambda cfg: not cfg.batch_norm)
def mlp(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    in_features = 1
    for d in input_shape:
        in_features *= d
    return MLP(in_features, tuple(cfg.widths), num_classes, bias=cfg.bias, batch_norm=cfg.batch_norm,
               dropout=cfg.dropout)


# ---------------------------------------------------------------- lenet


class LeNet5(nn.Sequential):
    """LeNet-5 with ReLU and max-pooling; 28×28 inputs are padded by 2 in the first conv (as 32×32).

    Both MNIST and CIFAR-10 thus reach 16×5×5 features before the fully connected layers.
    """

    def __init__(self, in_channels: int, size: int, num_classes: int):
        pad = max(0, (32 - size) // 2)
        side = ((size + 2 * pad - 4) // 2 - 4) // 2
        if side < 1:
            raise ConfigError(f"lenet needs inputs of at least 28×28 (after padding), got {size}×{size}")
        super().__init__(
            nn.Conv2d(in_channels, 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * side * side, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )


@register_model("lenet", families=("layer", "node", "logit_scale"), vectorizable=True)
def lenet(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, height, width = input_shape
    if height != width:
        raise ConfigError(f"lenet expects square inputs, got {height}×{width}")
    return LeNet5(channels, height, num_classes)


# ---------------------------------------------------------------- wide resnet


class WideBlock(nn.Module):
    """Pre-activation basic block: BN-ReLU-conv3×3(stride)-BN-ReLU-dropout-conv3×3, plus the shortcut.

    When the shape changes, the shortcut is a 1×1 conv applied to the pre-activated input (as in
    Zagoruyko & Komodakis); otherwise it is the identity on the raw input.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, dropout: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        act = torch.relu(self.bn1(x))
        out = self.conv2(self.dropout(torch.relu(self.bn2(self.conv1(act)))))
        return out + (self.shortcut(act) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    """WRN-depth-k: a 16-channel 3×3 stem, three groups of (depth − 4) / 6 blocks with 16k, 32k and 64k
    channels at strides 1, 2, 2, then BN-ReLU, global average pooling and a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, depth: int = 16, width: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise ConfigError(f"wrn depth must be 6k+4 with k ≥ 1 (10, 16, 22, 28, ...), got {depth}")
        if width < 1:
            raise ConfigError(f"wrn width must be a positive integer, got {width}")
        blocks_per_group = (depth - 4) // 6
        channels = [16, 16 * width, 32 * width, 64 * width]
        self.stem = nn.Conv2d(in_channels, channels[0], 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        for group, stride in enumerate((1, 2, 2)):
            for i in range(blocks_per_group):
                blocks.append(WideBlock(channels[group] if i == 0 else channels[group + 1],
                                        channels[group + 1], stride if i == 0 else 1, dropout))
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(channels[3])
        self.fc = nn.Linear(channels[3], num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """Kaiming-normal convs (fan-in, ReLU gain), unit-scale BN, zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn(self.blocks(self.stem(x))))
        return self.fc(out.mean(dim=(2, 3)))


@register_model("wrn", families=("layer", "node", "bn", "logit_scale"))
def wrn(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return WideResNet(input_shape[0], num_classes, depth=cfg.depth, width=cfg.width, dropout=cfg.dropout)


# ---------------------------------------------------------------- loading a trained model


def load_model(run_path: str | Path, device: str | torch.device = "cpu", model_file: Path | None = None,
               sha256: str | None = None, info: dict | None = None) -> nn.Module:
    """Rebuild a finished run's model from model.pt, or from `model_file` (a snapshot's) checked against
    `sha256`; a corrupt, replaced or edited file gives a one-line CheckpointError. `info`: the run's
    run.json when the caller has read it."""
    path = model_file or Path(run_path) / MODEL_FILE
    if sha256 is not None or model_file is None:
        if info is None:
            info = load_run_info(run_path) if (Path(run_path) / RUN_JSON).is_file() else {}
        check_model_hash(Path(run_path), info, path, sha256)
    blob = torch_load(path, map_location=device)
    if not isinstance(blob, dict) or "state_dict" not in blob or "config" not in blob:
        raise CheckpointError(f"{path} is not a flatbench model file; delete the run folder to retrain")
    try:
        cfg = run_config_from_dict(blob["config"])
        model = build_model(cfg.model, tuple(int(n) for n in blob["input_shape"]), int(blob["num_classes"]))
    except (KeyError, TypeError, ValueError, FlatbenchError) as exc:
        raise CheckpointError(f"{path} is not a flatbench model file ({type(exc).__name__}: {exc}); delete the run "
                              "folder to retrain") from None
    try:
        model.load_state_dict(blob["state_dict"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path} does not match its model config ({str(exc).splitlines()[0]})") from None
    return model.to(device).eval()
