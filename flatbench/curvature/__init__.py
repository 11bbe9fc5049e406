"""The curvature engine: the loss Hessian as one operator, its exact diagonal, HVPs, Lanczos.

Every Hessian-based measure asks one object, `HessianOperator(model, inputs, targets, loss)`, for what it
needs: `H @ v`, `H.trace()`, `H.diagonal()`, `H.top_eigenvalues()`. `flatbench.measures.shared` builds it
once per (model, loss) and caches what measures share (the diagonal).

    operator.py       HessianOperator: products, Hutchinson trace and diagonal, top eigenvalues, and the
                      choice between the exact and the estimated diagonal
    diagonal.py       the exact Hessian diagonal of piecewise-linear networks (the method is explained there)
    smooth.py         the exact Hessian diagonal of Sequential chains with smooth activations (GGN + σ'' terms)
    applicability.py  which networks qualify (`exact_applicable`), the traced aten operations of a forward
    group.py          the exact diagonal of G same-architecture MLPs at once (one batched computation)
    hvp.py            Hessian-vector products in chunks, and the dense diagonal of a small model of any
                      architecture (one backward pass per parameter)
    modes.py          which derivative mode computes a product: auto is double backward; a torch.func mode
                      is checked against it on its first product on a model (and replaced where it disagrees);
                      the log of the products a measure made (its entry's info["hvp"])
    trace.py          Tr H to a requested relative standard error by adaptive Hutch++
    lanczos.py        top eigenvalues by Lanczos of any symmetric operator; the Lanczos tridiagonal
    density.py        the spectral density by stochastic Lanczos quadrature
    common.py         chunking, flat parameter vectors, probes, the loss as a function of the parameters
"""

from flatbench.curvature.applicability import (
    POSITIVELY_HOMOGENEOUS_OPS,
    exact_applicable,
    ops_outside,
    register_piecewise_linear_container,
    traced_ops,
)
from flatbench.curvature.density import DENSITY_DEFAULTS, slq, spectral_density
from flatbench.curvature.diagonal import DiagonalResult, logit_factors, per_layer_traces
from flatbench.curvature.group import group_hessian_diagonals, mlp_linears
from flatbench.curvature.hvp import check_mode, hvp, math_attention
from flatbench.curvature.modes import (AUTO_MODE, HVP_MODES, HvpLog, ModeCheck, check_tolerance, forward_ad_missing,
                                       hvp_log, hvp_mode_of, use_hvp_mode)
from flatbench.curvature.lanczos import lanczos_operator
from flatbench.curvature.operator import (DEFAULT_HUTCHINSON_PROBES, DENSE_MAX_PARAMS, HessianOperator,
                                          hessian_diagonal)
from flatbench.curvature.smooth import smooth_chain
from flatbench.curvature.trace import HUTCHPP_DEFAULTS, hutchpp_trace

__all__ = [
    "AUTO_MODE",
    "DEFAULT_HUTCHINSON_PROBES",
    "DENSE_MAX_PARAMS",
    "DENSITY_DEFAULTS",
    "HUTCHPP_DEFAULTS",
    "HVP_MODES",
    "POSITIVELY_HOMOGENEOUS_OPS",
    "DiagonalResult",
    "HessianOperator",
    "HvpLog",
    "ModeCheck",
    "check_mode",
    "check_tolerance",
    "exact_applicable",
    "forward_ad_missing",
    "group_hessian_diagonals",
    "hessian_diagonal",
    "hvp",
    "hvp_log",
    "hutchpp_trace",
    "hvp_mode_of",
    "lanczos_operator",
    "logit_factors",
    "math_attention",
    "mlp_linears",
    "ops_outside",
    "per_layer_traces",
    "register_piecewise_linear_container",
    "slq",
    "smooth_chain",
    "spectral_density",
    "traced_ops",
    "use_hvp_mode",
]
