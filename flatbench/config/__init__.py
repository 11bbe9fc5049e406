"""Study configs: what a study is (`schema`: the sections' dataclasses, a run's identity and id) and how a
YAML file becomes one (`parse`: validation, `key=value` overrides, sweep expansion).

Everything is re-exported here, so callers import from `flatbench.config`.
"""

from flatbench.config.schema import (
    EXECUTION_ONLY_KEYS, RUN_ID_HASH_CHARS, SECTIONS, SWEEPABLE, TOP_LEVEL, DataConfig, dotted,
    identity_diff, MeasureConfig, ModelConfig, ReportConfig, RunConfig, snapshot_folder_name, Study,
    to_plain, TrainConfig,
)
from flatbench.config.parse import (
    MAX_UNIFORM_RATIOS, apply_overrides, field_types, load_study, load_yaml, parse_study,
    parse_vectorize, run_config_from_dict, type_name,
)

__all__ = [
    "DataConfig", "EXECUTION_ONLY_KEYS", "MAX_UNIFORM_RATIOS", "MeasureConfig", "ModelConfig",
    "RUN_ID_HASH_CHARS", "ReportConfig", "RunConfig", "SECTIONS", "SWEEPABLE", "Study", "TOP_LEVEL",
    "TrainConfig", "apply_overrides", "dotted", "field_types", "identity_diff", "load_study",
    "load_yaml", "parse_study", "parse_vectorize", "run_config_from_dict", "snapshot_folder_name",
    "to_plain", "type_name",
]
