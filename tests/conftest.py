"""Shared fixtures: tiny study configs, running the real CLI, and the full-dataset rule.

Full-dataset tests need `FLATBENCH_DATA` (MNIST) or `FLATBENCH_CIFAR10_ROOT` (prepared CIFAR-10). On CI
(`CI` set) a missing or unreadable dataset is a failure, never a skip; elsewhere the test skips and says
why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("MPLBACKEND", "Agg")
# The tests use tiny tensors: thread start-up and spinning cost more than they save, and badly so on a
# shared 2-core machine. Subprocesses (the real CLI) get one thread too unless a test sets it (the workers'
# tests do): an OpenMP thread spinning on a core that another process holds made a 0.9 s training run take
# 52 s on this machine under load (tests/training/test_loop.py's resume test: 103 s).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module", autouse=True)
def _registry_as_before():
    """The measure registry as it was before each test module: a plugin a module loads in this process (a
    docs example, a broken measure of the isolation tests) is gone after it, so that a later module's `all`
    (the committed studies' configs say `all`) never includes it."""
    from flatbench.measures import all_measures, registry

    all_measures()
    saved = dict(registry.REGISTERED)
    yield
    registry.REGISTERED.clear()
    registry.REGISTERED.update(saved)


TINY = {
    "name": "tiny",
    "seed": 0,
    "data": {"dataset": "mnist_mini", "n_train": 300, "n_test": 200, "random_label_ratio": [0.0, 0.5, 1.0]},
    "model": {"name": "mlp", "widths": [32]},
    "train": {"epochs": 3, "batch_size": 64, "lr": 0.003},
    "measure": {"measures": ["frobenius_norm", "spectral_norm", "path_norm"], "n_examples": 200},
    "report": {"min_train_acc": 0.0},  # 3 epochs fit nothing: the plumbing, not the science, is tested
}


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a study config (TINY updated with `changes`, section by section) and return its path."""

    def write(changes: dict | None = None, name: str = "tiny.yaml") -> Path:
        raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
        for key, value in (changes or {}).items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key].update(value)
            else:
                raw[key] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return path

    return write


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
            ) -> subprocess.CompletedProcess:
    """Run `python -m flatbench ARGS` as a user would, capturing its output."""
    full_env = {**os.environ, "MPLBACKEND": "Agg", **(env or {})}
    return subprocess.run([sys.executable, "-m", "flatbench", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def cli_ok(result: subprocess.CompletedProcess) -> str:
    """The stdout of a CLI call that must succeed (its output shown when it did not)."""
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def cli_one_line_error(result: subprocess.CompletedProcess, *parts: str) -> None:
    """A CLI call refused as the project refuses bad input: exit 2 and one `error: ...` line holding `parts`."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def require_full_data(env_var: str, probe: str) -> Path:
    """The dataset root from `env_var`, checked to contain `probe`; fail on CI, skip elsewhere."""
    root = os.environ.get(env_var)
    problem = None
    if not root:
        problem = f"{env_var} is not set"
    elif not (Path(root) / probe).exists():
        problem = f"{Path(root) / probe} does not exist"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"full-dataset test cannot read its data on CI: {problem}")
        pytest.skip(f"full dataset not available: {problem}")
    return Path(root)


def in_process(*args: str) -> subprocess.CompletedProcess:
    """`flatbench ARGS` through the CLI's own entry point (`flatbench.cli.main`, what the console script
    calls) in this process: the same parsing, checks and error lines as a subprocess, without the seconds
    of a fresh interpreter importing torch."""
    import contextlib
    import io

    from flatbench.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["flatbench", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def own_registry():
    """The registry as it was before the test (measures registered or plugins loaded in the test are
    removed after it)."""
    from flatbench.measures import all_measures, registry

    all_measures()
    saved = dict(registry.REGISTERED)
    yield
    registry.REGISTERED.clear()
    registry.REGISTERED.update(saved)
