"""Flatness measures. Each module registers its measures with `register_measure`; see registry.py."""

from flatbench.measures.registry import (MeasureOutput, MeasureSpec, NotApplicable, all_measures,
                                         get_measure, register_measure, resolve_names)

__all__ = ["MeasureOutput", "MeasureSpec", "NotApplicable", "all_measures", "get_measure",
           "register_measure", "resolve_names"]
