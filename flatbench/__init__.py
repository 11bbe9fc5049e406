"""flatbench: does a flatness measure track generalization, and does it survive reparametrization?

The package trains models on partly random labels, computes every registered flatness measure on each
trained model and reports how well each measure ranks the models by their generalization gap.

The public API (imported lazily, so `import flatbench` is instant):

    flatbench.measure(model, (x, y), ["hessian_trace", "path_norm"])    # any nn.Module → a DataFrame
    flatbench.verify(model, (x, y))        # its curvature against the dense Hessian, check by check
    from flatbench import register_measure, MeasureContext, NotApplicable   # writing a measure plugin
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["MeasureContext", "MeasureOutput", "NotApplicable", "load_plugins", "measure", "register_measure", "verify"]


def __getattr__(name: str) -> Any:
    if name == "measure":
        from flatbench.api import measure  # lazy: `import flatbench` must stay instant

        return measure
    if name == "verify":
        from flatbench.verification import verify  # lazy: `import flatbench` must stay instant

        return verify
    if name == "load_plugins":
        from flatbench.measures.registry import load_plugins  # lazy: `import flatbench` must stay instant

        return load_plugins
    if name in __all__:
        from flatbench.measures import plugin  # lazy: `import flatbench` must stay instant

        return getattr(plugin, name)
    raise AttributeError(f"module 'flatbench' has no attribute {name!r}")
