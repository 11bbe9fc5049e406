"""Glue between the CLI and the report module: which report settings apply to an experiment folder."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import yaml

from flatbench.config import ReportConfig, parse_study
from flatbench.store import STUDY_FILE


def report_config_of(exp_dir: Path) -> ReportConfig:
    """The `report` section of the experiment's saved study.yaml (defaults when there is none)."""
    saved = Path(exp_dir) / STUDY_FILE
    if not saved.is_file():
        return ReportConfig()
    raw = yaml.safe_load(saved.read_text()) or {}
    return parse_study({"report": raw.get("report") or {}}, default_name="report").report


def report_experiment(exp_dirs: list[Path], out_dir: Path, cfg: ReportConfig,
                      echo: Callable[[str], None] = print, quiet: bool = False) -> object:
    from flatbench.report import write_report

    return write_report([Path(d) for d in exp_dirs], Path(out_dir), gap=cfg.gap,
                        min_train_acc=cfg.min_train_acc, quiet=quiet, echo=echo)
