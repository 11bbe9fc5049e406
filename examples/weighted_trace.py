"""An example measure plugin: the Hessian diagonal weighted by the squared weights, Σ_i θ_i² H_ii.

Scaling one parameter by c > 0 scales its Hessian diagonal entry by 1/c², so the sum is unchanged by every
function-preserving rescaling that scales parameters one by one: layer-wise, node-wise and BatchNorm
rescaling (not by a rescaling of the logits, which changes the loss). It reuses the Hessian diagonal
that flatbench computes once per model and loss (exact for piecewise-linear networks).

    flatbench list-measures --plugin examples/weighted_trace.py
    flatbench check-measure weighted_trace --plugin examples/weighted_trace.py
    flatbench run configs/quickstart.yaml --plugin examples/weighted_trace.py --measures weighted_trace,hessian_trace
"""

from flatbench import MeasureContext, MeasureOutput, register_measure
from flatbench.measures.plugin import hessian_diagonal


@register_measure("weighted_trace", description="Σ_i θ_i² H_ii: the Hessian diagonal weighted by the squared "
                  "weights (example plugin)", invariant_to=("layer", "node", "bn"), cost="hessian", uses_loss=True)
def weighted_trace(ctx: MeasureContext) -> MeasureOutput:
    diag = hessian_diagonal(ctx)  # shared with hessian_trace, normalized_sharpness, ...: computed once
    params = dict(ctx.model.named_parameters())
    per_tensor = {name: float((params[name].detach().double().pow(2) * d).sum()) for name, d in diag.diag.items()}
    values = {"weighted_trace": sum(per_tensor.values())}
    values.update({f"weighted_trace/{name}": v for name, v in per_tensor.items()})
    return MeasureOutput(values, {"method": diag.method})
