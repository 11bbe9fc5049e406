"""The curvature engine: exact Hessian diagonal, Hessian-vector products, Hutchinson, Lanczos.

Every Hessian-based measure rests on these primitives; `flatbench.measures.shared` computes them once per
(model, loss) and shares them between measures.

    diagonal.py   the exact Hessian diagonal of piecewise-linear networks (the method is explained there),
                  with the Hutchinson fallback; which networks qualify (`exact_applicable`)
    group.py      the same for G same-architecture MLPs at once (one batched computation)
    hvp.py        Hessian-vector products; Hutchinson's trace and diagonal estimators
    lanczos.py    top eigenvalues by Lanczos, of the Hessian or of any symmetric operator
    common.py     chunking, flat parameter vectors, probes, the loss as a function of the parameters
"""

from flatbench.curvature.diagonal import (DiagonalResult, exact_applicable, hessian_diagonal, logit_factors,
                                          per_layer_traces, register_piecewise_linear_container)
from flatbench.curvature.group import group_hessian_diagonals, mlp_linears
from flatbench.curvature.hvp import DEFAULT_HUTCHINSON_PROBES, hutchinson_trace, hvp
from flatbench.curvature.lanczos import lanczos, lanczos_operator

__all__ = ["DEFAULT_HUTCHINSON_PROBES", "DiagonalResult", "exact_applicable", "group_hessian_diagonals",
           "hessian_diagonal", "hutchinson_trace", "hvp", "lanczos", "lanczos_operator", "logit_factors", "mlp_linears",
           "per_layer_traces", "register_piecewise_linear_container"]
