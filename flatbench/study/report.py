"""The report stage in one pass: folders → records → tables → statistics → document, each read once. This
module says which runs of which experiment folders a report covers, with which settings, and checks them
before anything is written; it reads the runs once (`table.report_inputs`: the records and their tables)
and hands them to `flatbench.analysis.report.write_report`, which computes the statistics once and writes
the files and the document from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from flatbench import store
from flatbench.analysis.report import ReportSummary, write_report, write_statistics
from flatbench.analysis.table import ReportInputs, load_records, report_inputs, snapshot_records
from flatbench.config import ReportConfig
from flatbench.errors import ConfigError, FlatbenchError
from flatbench.measures.keys import parse_key
from flatbench.measures.registry import get_measure
from flatbench.measures.stale import drop_stale
from flatbench.study.kept import kept_on_failure
from flatbench.study.spec import check_output_dir, read_saved_study
from flatbench.study.validity import finished_run_problem


def report_study(exp_dirs: list[Path], out_dir: Path | None = None, gap: str | None = None,
                 min_train_acc: float | None = None, include_stale: bool | None = None,
                 echo: Callable[[str], Any] = print, quiet: bool = False, seed: int = 0,
                 statistics_only: bool = False) -> ReportSummary | None:
    """The report stage over experiment folders, as `flatbench report` runs it. `seed` seeds the report's
    resampling (bootstrap and Monte-Carlo permutations; `flatbench report --seed`). `statistics_only`
    writes the tables and statistics files alone (`analysis.report.write_statistics`) and returns None.

    Each folder's saved study (study.yaml) says which runs are the study's now: run folders left by an
    earlier version of its config are listed as not in this study and left out (`include_stale` counts
    them). Settings default to the first folder's `report` section. Everything is checked before anything
    is written: the folders, the settings, the output folder, damaged files (refused, so that a report is
    never silently built from half a study) and that some run can be used (a good report is never
    replaced by an empty one).
    """
    exp_dirs = _distinct([Path(p) for p in exp_dirs])
    saved, current = _read_folders(exp_dirs)
    cfg = _settings(saved or ReportConfig(), gap, min_train_acc, include_stale)
    out = check_output_dir(out_dir or exp_dirs[0], "report folder")
    inputs = _read_runs(exp_dirs, current, cfg, echo)
    echo(f"building the report from {len(inputs.records)} runs"
         + (f" ({len(inputs.stale)} left out as not in this study)" if inputs.stale else "") + " ...")
    with kept_on_failure(out):  # a report that fails part-way (a full disk) leaves the previous one whole
        if statistics_only:
            write_statistics(exp_dirs, out, cfg, inputs, seed=seed)
            return None
        return write_report(exp_dirs, out, cfg, inputs=inputs, seed=seed, quiet=quiet, echo=echo)


def _read_folders(exp_dirs: list[Path]) -> tuple[ReportConfig | None, dict[Path, set[str] | None]]:
    """The first saved study's report settings (None without one) and, per folder, the run ids of its saved
    study (None: no study.yaml, every run folder counts); refuses what is not an experiment folder."""
    cfg: ReportConfig | None = None
    current: dict[Path, set[str] | None] = {}
    for path in exp_dirs:
        if not path.exists():
            raise FlatbenchError(f"experiment folder {path} does not exist")
        if not path.is_dir():
            raise FlatbenchError(f"{path} is a file, not an experiment folder")
        check_regular_files(path)
        if (path / store.STUDY_FILE).is_file():
            study = read_saved_study(path)
            current[path] = set(study.run_ids())
            cfg = cfg or study.report
        elif (path / store.RUNS_DIR).is_dir():
            current[path] = None  # no saved study: every run folder counts
        else:
            raise FlatbenchError(f"{path} is not a flatbench experiment folder (no {store.STUDY_FILE} and no "
                                 f"{store.RUNS_DIR}/ inside)")
    return cfg, current


def _settings(cfg: ReportConfig, gap: str | None, min_train_acc: float | None,
              include_stale: bool | None) -> ReportConfig:
    """The saved settings with the command line's on top (each checked)."""
    if gap is not None:
        cfg = replace(cfg, gap=gap)
    if min_train_acc is not None:
        if not 0.0 <= min_train_acc <= 1.0:
            raise ConfigError(f"--min-train-acc must be a train accuracy in [0, 1], got {min_train_acc:g}")
        cfg = replace(cfg, min_train_acc=min_train_acc)
    if include_stale is not None:
        cfg = replace(cfg, include_stale=include_stale or cfg.include_stale)
    return cfg


def _read_runs(exp_dirs: list[Path], current: dict[Path, set[str] | None], cfg: ReportConfig,
               echo: Callable[[str], Any]) -> ReportInputs:
    """Every run read once and checked (damaged files, damaged runs, one setting per measure), the runs not
    in the study set aside, stale entries dropped, then the tables built: the report's inputs."""
    records = load_records(exp_dirs)
    damaged = [problem for rec in records for problem in rec.problems]
    if damaged:
        raise FlatbenchError(f"{len(damaged)} damaged file(s), e.g. {damaged[0]}: run `flatbench measure` on the "
                             "experiment to repair measures.json files (their readable entries are kept), or "
                             "move the damaged run away; the report was not written")
    check_runs_valid(records)
    stale = []
    if not cfg.include_stale:
        stale = [rec for rec in records if current.get(rec.path.parent.parent) is not None
                 and rec.run_id not in current[rec.path.parent.parent]]
        records = [rec for rec in records if rec not in stale]
    levels = snapshot_records(records)
    dropped = drop_stale([*records, *(rec for recs in levels.values() for rec in recs)])
    if dropped:
        echo(f"warning: {sum(dropped.values())} entries of {', '.join(sorted(dropped))} left out: stale (their "
             "plugin file changed since they were computed; `flatbench measure` recomputes them)")
    damaged = [problem for recs in levels.values() for rec in recs for problem in rec.problems]
    if damaged:
        raise FlatbenchError(f"{len(damaged)} damaged snapshot file(s), e.g. {damaged[0]}: run `flatbench measure` "
                             "on the experiment to repair it; the report was not written")
    check_one_setting(records, "")
    for level, recs in levels.items():
        check_one_setting(recs, f" (snapshots at train loss {level:g})")
    return report_inputs(exp_dirs, records, levels, stale, _measure_info(records))


def check_regular_files(exp: Path) -> None:
    """study.yaml and every run's run.json and measures.json, where they are, must be regular files with
    something in them: a folder, a link to /dev/null or an empty file is damage, refused in one line before
    anything is written (never read as a study without runs or a run without values)."""
    paths = [exp / store.STUDY_FILE]
    runs = exp / store.RUNS_DIR
    if runs.is_dir():
        for run in sorted(runs.iterdir()):
            if run.is_dir():
                paths += [run / store.RUN_JSON, run / store.MEASURES_JSON]
    fixes = {store.STUDY_FILE: "restore it or re-run `flatbench train` with the study's config",
             store.RUN_JSON: "move the run folder away or delete it to retrain",
             store.MEASURES_JSON: "remove it and run `flatbench measure` on the experiment"}
    for path in paths:
        problem = store.file_problem(path)
        if problem:
            raise FlatbenchError(f"{path} is damaged ({problem}); {fixes[path.name]}; the report was not written")


def check_runs_valid(records: list) -> None:
    """Refuse a report built from a run that `flatbench status` calls damaged (`study.validity`: a run.json
    copied, linked or edited so that it describes another run than its folder's, a model.pt that is not the
    file its run wrote) or from one run.json counted twice (a run folder linked into two experiments): one
    line naming the runs, nothing written."""
    bad, seen = [], {}
    for rec in records:
        if rec.info.get("status") != "finished":
            continue
        problem = finished_run_problem(rec.path, rec.info, need_model=False)
        real = (rec.path / store.RUN_JSON).resolve()
        if problem is None and real in seen:
            problem = f"{rec.path} is {seen[real]} again (linked or copied folder): it would count twice"
        seen.setdefault(real, rec.path)
        if problem:
            bad.append((rec.path.name, problem))
    if bad:
        names = ", ".join(name for name, _ in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise FlatbenchError(f"{len(bad)} damaged run(s) ({names}), e.g. {bad[0][1]}: `flatbench status` lists "
                             "them as damaged; move them away or retrain them; the report was not written")


def _distinct(paths: list[Path]) -> list[Path]:
    """The experiment folders, each once (`report EXP EXP`, `report EXP ./EXP`: one folder, its runs counted
    once), in the order given."""
    seen: set[Path] = set()
    out = []
    for path in paths:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def check_one_setting(records: list, where: str) -> None:
    """Refuse to put values of one measure computed with different settings or on different measurement
    sets (`context`: n_examples, dtype, normalized_ce_tau) side by side: one line naming the measure, the
    two settings and a run of each, so that a report never mixes two definitions under one name."""
    for key in sorted({k for rec in records for k in rec.measures}):
        seen: dict[str, list[str]] = {}
        for rec in records:
            entry = rec.measures.get(key)
            if not entry or entry.get("status") != "ok":
                continue
            settings = {k: v for k, v in (entry.get("settings") or {}).items() if k != "loss"}
            text = json.dumps({"context": entry.get("context"), "settings": settings}, sort_keys=True, default=str)
            seen.setdefault(text, []).append(rec.run_id)
        if len(seen) > 1:
            (a, runs_a), (b, runs_b) = sorted(seen.items(), key=lambda kv: -len(kv[1]))[:2]
            raise FlatbenchError(
                f"{key}{where} was computed with different measurement settings: {_describe(a, b)} on "
                f"{len(runs_a)} run(s) (e.g. {runs_a[0]}), {_describe(b, a)} on {len(runs_b)} (e.g. {runs_b[0]}); "
                "re-run `flatbench measure EXPERIMENT --force` with one setting; the report was not written")


def _describe(text: str, other: str) -> str:
    """The fields of one setting that differ from another's (`n_examples=250, dtype=float32`)."""
    a, b = json.loads(text), json.loads(other)
    flat_a = {**(a.get("context") or {}), **a.get("settings", {})}
    flat_b = {**(b.get("context") or {}), **b.get("settings", {})}
    if a.get("context") is None:
        flat_a["context"] = "none recorded"
    diff = [f"{k}={flat_a.get(k)}" for k in sorted(set(flat_a) | set(flat_b)) if flat_a.get(k) != flat_b.get(k)]
    return ", ".join(diff) or "another setting"


def _measure_info(records: list) -> dict[str, Any]:
    """The registry's spec (description, cost) of every measure the records hold a result of."""
    info = {}
    for name in {parse_key(key).measure for rec in records for key in rec.measures}:
        try:
            info[name] = get_measure(name)
        except FlatbenchError:
            continue  # a measure this version does not know: the report says "(not registered)"
    return info
