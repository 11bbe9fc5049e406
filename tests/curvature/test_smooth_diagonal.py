"""The exact Hessian diagonal and trace of smooth Sequential chains (`curvature.smooth`) against
`torch.func.hessian` of the loss as a function of the flat parameter vector, in float64.

Every net is tiny (≤ 200 parameters, 24 examples), so the dense Hessian is the ground truth. The tolerance
is 1e-10 relative to the largest diagonal element (issue 29's criterion); measured errors are ~1e-15.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn


from flatbench.curvature import hessian_diagonal, smooth_chain
from flatbench.curvature import smooth as smooth_module
from flatbench.losses import get_loss
from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import compute_entry

from cases import dense_hessian

N, C = 24, 4
TOL = 1e-10
ACTIVATIONS = {"tanh": nn.Tanh, "gelu": nn.GELU, "silu": nn.SiLU, "softplus": nn.Softplus,
               "sigmoid": nn.Sigmoid}


def flat(diag: dict[str, Tensor], net: nn.Module) -> Tensor:
    return torch.cat([diag[k].reshape(-1) for k, _ in net.named_parameters()])


def chain(act: type[nn.Module]) -> nn.Module:
    """Two smooth layers with a ReLU between them, so residual factors pass through a ReLU and a Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), act(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 5), act(),
                         nn.Linear(5, C)).double().eval()


def data(seed: int = 1, shape: tuple[int, ...] = (6,)) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, *shape, generator=gen, dtype=torch.float64), torch.randint(0, C, (N,), generator=gen)


def max_error(net: nn.Module, x: Tensor, y: Tensor, loss_name: str, chunk_size: int = 2000) -> tuple[float, float]:
    """(max |diag error| / max |H_kk|, |trace error| / |Tr H|) of the exact diagonal."""
    loss = get_loss(loss_name)
    hess = dense_hessian(net, x, y, loss)
    result = hessian_diagonal(net, x, y, loss, chunk_size=chunk_size)
    assert result.method == "exact", result.reason
    err = float((flat(result.diag, net) - hess.diagonal()).abs().max() / hess.diagonal().abs().max())
    return err, abs(result.trace() - float(hess.trace())) / abs(float(hess.trace()))


@pytest.mark.parametrize("loss_name", ["ce", "normalized_ce", "mse"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_smooth_diagonal_and_trace_equal_the_dense_hessian(act: str, loss_name: str) -> None:
    x, y = data()
    diag_err, trace_err = max_error(chain(ACTIVATIONS[act]), x, y, loss_name, chunk_size=10)
    assert diag_err < TOL and trace_err < TOL, (diag_err, trace_err)


def test_the_second_derivative_terms_are_what_makes_it_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the σ'' residual (the GGN alone) the same comparison fails by far: the test can fail."""
    net = chain(nn.Tanh)
    x, y = data()
    assert max_error(net, x, y, "ce")[0] < TOL
    real = smooth_module._derivatives
    monkeypatch.setattr(smooth_module, "_derivatives", lambda m, z: (real(m, z)[0], torch.zeros_like(z)))
    assert max_error(net, x, y, "ce")[0] > 1e-3


def test_nested_chains_batchnorm_flatten_and_other_activations() -> None:
    """Flatten of image-shaped inputs, a nested Sequential, BatchNorm1d with running statistics, inactive
    Dropout, GELU's tanh approximation, in-place ELU and SiLU, LeakyReLU, an activation on the logits."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(7)
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 7), bn, nn.GELU(approximate="tanh"),
                        nn.Sequential(nn.Dropout(0.5), nn.Linear(7, 6, bias=False), nn.ELU(inplace=True)),
                        nn.Linear(6, 5), nn.LeakyReLU(0.1), nn.Linear(5, 5), nn.SiLU(inplace=True),
                        nn.Linear(5, C), nn.Tanh()).double().eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.uniform_(0.5, 2)
    x, y = data(shape=(2, 3))
    diag_err, trace_err = max_error(net, x, y, "ce")
    assert diag_err < TOL and trace_err < TOL, (diag_err, trace_err)


def test_one_activation_module_used_twice() -> None:
    torch.manual_seed(0)
    act = nn.Softplus(beta=2.0)
    net = nn.Sequential(nn.Linear(6, 7), act, nn.Linear(7, 5), act, nn.Linear(5, C)).double().eval()
    x, y = data()
    diag_err, trace_err = max_error(net, x, y, "ce")
    assert diag_err < TOL and trace_err < TOL, (diag_err, trace_err)


def test_what_is_not_a_smooth_chain() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.tanh(self.a(x)))

    shared = nn.Linear(3, 3)
    assert smooth_chain(chain(nn.Tanh))[0] is not None
    for net, word in ((Wrapper(), "Wrapper"), (nn.Sequential(shared, nn.Tanh(), shared), "twice"),
                      (nn.Sequential(nn.Linear(3, 3), nn.Softmax(-1), nn.Linear(3, 2)), "Softmax"),
                      (nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3).train(), nn.Linear(3, 2)), "batch")):
        leaves, reason = smooth_chain(net)
        assert leaves is None and word in reason, reason


def test_hessian_trace_measure_is_exact_on_a_gelu_mlp() -> None:
    net = chain(nn.GELU)
    x, y = data()
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=C)
    spec = get_measure("hessian_trace")
    entry = compute_entry(ctx, spec, dict(spec.defaults), "ce")
    assert entry["status"] == "ok" and entry["info"]["method"] == "exact", entry
    exact = float(dense_hessian(net, x, y, get_loss("ce")).trace())
    assert abs(entry["values"]["hessian_trace"] - exact) < TOL * abs(exact)
