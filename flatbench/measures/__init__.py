"""Flatness measures: the framework (registry, context, runner, cache, keys) and the built-in plugins.

    registry.py   the registry, in one module: `MeasureSpec` and the store, `register_measure` and its checks,
                  loading the built-in measures and plugins, `get_measure`, `resolve_names`, variants
    plugin_import.py  how a plugin file, module or entry point is found and imported (for the registry)
    keys.py       result keys `name[:variant][@loss][/detail]`: built and split in one place (no torch)
    runner.py     computing measures on a trained model, cached entry by entry in measures.json
    context.py    what a measure function sees (model, measurement set, loss, seeded generators, cache)
    shared.py     quantities several measures share (Hessian diagonal, weight layers), cached once
    layers.py     the weight layers of a model in forward order
    plugin.py     the one module a measure author reads: `register_measure`, `MeasureContext`, ...
    contract.py   the invariance contract: a catalogue of trained models, rescaled, checked (check-measure)
    builtin/      the built-in measures, one module per family, registered exactly as a plugin is

The registry API is re-exported here lazily, so `flatbench.measures.keys` can be used without loading
torch or any measure.
"""

from typing import Any

__all__ = ["MeasureOutput", "MeasureSpec", "NotApplicable", "all_measures", "get_measure",
           "register_measure", "resolve_names"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from flatbench.measures import registry  # lazy: measures.keys must load without torch or any measure

        return getattr(registry, name)
    raise AttributeError(f"module 'flatbench.measures' has no attribute {name!r}")
