"""`flatbench audit EXPERIMENT --population`: do the measures keep their correlation with the gap under
reparametrization? (The run audit and the pieces both audits share are in `flatbench.study.audit`.)

**Population audit** (`flatbench audit EXPERIMENT_DIR --population [--family node] [--draws 3]
[--max-factor 2 --max-factor 100]`): the papers' central claim made executable. Every finished run of the
experiment gets `--draws` random function-preserving transformations of one family for each factor range
[1/F, F] (default: 3 draws for each of the mild range F = 2 and the harsh range F = 100), each seeded by
run, family, range and draw (`population_rescaling`); the measures are recomputed on every transformed
copy, and each measure's Kendall τ-b with the generalization gap (the study's `report.gap`; the report's
τ and permutation test, `analysis.stats.kendall_tests`) on the population of copy d of range F is set
against the untransformed τ:
Δτ = τ_transformed − τ_original, one value per draw, reported as a distribution (mean, min, max,
largest |Δτ| and every draw's τ). The gap does not change, so a measure worth using keeps its
correlation. Untransformed values come from the run's measures.json where present (they were computed with
the same settings), otherwise they are computed once. As in the report, a measure whose registry entry
says `larger_is_sharper=False` is negated first, so a positive τ means "tracks the gap".

All copies of a run are made in one pass: its context (model, data, measurement set) is built once, its
untransformed values are read once, and each copy is a target (`population_rescaling`) loaded from that
context as the measure stage loads its models (`measures.runner.load_context`: a checked transformed copy
with an empty cache, so each value is the one the copy gets when measured alone). What the copies do share
is the run's random draws (`MeasureContext.draws`: the Monte-Carlo measures' noise, which depends on the
run's seed and the parameters' shapes, not on their values): a copy reads the numbers it would draw alone
instead of drawing them again (tests/study/test_audit.py checks every value against the copy measured alone).
The finished runs are written to audit_population.csv as they finish (`SAVE_COST_RATIO` spaces the rewrites
of a large file), at the end and when interrupted, and a later call with the same settings (measure config, plugin and loss files, family, model file) reuses them, so
an interrupted (or killed) audit goes on where it stopped (`fresh=True` / `--fresh` recomputes everything).

Written to the experiment folder (or `--out`):

- `audit_population.csv`: one row per (run, measure, range, draw) (`POPULATION_COLUMNS`);
- `audit_correlations.csv`: one row per (measure, range) (`CORRELATION_COLUMNS`, then each draw's τ,
  `median_rel_change, declared_invariant, status, note`); `status` is `ok`, `partial` (some draws have no
  τ), `no_transformed` (no draw has one: the measure failed or was constant on the copies) or
  `no_original` (no untransformed τ); a missing τ or Δτ is left empty (NaN), never 0;
- `audit_draws.csv`: one row per (measure, range, draw) with its τ, Δτ and permutation p;
- `audit_correlations.png` (`analysis.audit_plots`): per measure, τ_original and every draw's τ for each
  range.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from flatbench.analysis.audit_tables import format_correlations
from flatbench.analysis.stats import MIN_RUNS, gap_column, kendall_tests
from flatbench.errors import Echo, FlatbenchError
from flatbench.losses import loss_source
from flatbench.store import atomic_write_bytes, atomic_write_text, is_finished
from flatbench.analysis.audit_plots import audit_correlations_figure
from flatbench.measures.registry import all_measures, get_measure, load_plugins
from flatbench.measures.runner import FUNCTION_CHANGE, ContextPlan, load_context, plan_contexts, up_to_date
from flatbench.measures.targets import Rescaling, read_entries
from flatbench.rescale import applicable_families
from flatbench.study.workers import run_jobs
from flatbench.measures.contract import rel_change
from flatbench.study.audit import (Entry, measure_entry, declared_invariant, headline, measure_config,
                                   parse_families, plan_entries, report_gap, study_run_dirs)

POPULATION_CSV = "audit_population.csv"
CORRELATIONS_CSV = "audit_correlations.csv"
CORRELATIONS_PNG = "audit_correlations.png"
DRAWS_CSV = "audit_draws.csv"

DEFAULT_MAX_FACTORS = (2.0, 100.0)
"""The population audit's factor ranges [1/F, F]: mild (F = 2) and harsh (F = 100)."""
DEFAULT_DRAWS = 3
"""Random transformations per run and factor range."""
SAVE_COST_RATIO = 20.0
"""audit_population.csv is rewritten after a finished run once the time since its last rewrite is at least
this many times what that rewrite took (and at the end, and when the audit is interrupted): a small audit
is written after every run, a large one every few seconds, and the writing costs at most 1/20 of the
audit's time. Rewriting the whole file after every run made the audit of a study of many runs quadratic
(540 runs: about 15 million rows formatted); a killed audit loses at most 20 rewrites' time of work."""
POPULATION_COLUMNS = ["run_id", "measure", "family", "max_factor", "draw", "original", "transformed",
                      "rel_change", "gap", "status", "note", "original_source", "function_change", "seconds",
                      "signature"]


def population_rescaling(run_id: str, family: str, max_factor: float, draw: int) -> Rescaling:
    """Copy `draw` of range [1/F, F] of a run (a rescaled target): its factors seeded by run, family, range and
    draw, so every copy is reproducible on its own."""
    return Rescaling(family, max_factor, draw, ("audit_population", run_id, family, f"{float(max_factor):g}", draw))


def parse_max_factors(values: Any) -> tuple[float, ...]:
    """Factor ranges from a number, a comma list ('2,100') or a sequence of either; each must be > 1."""
    if values is None:
        return DEFAULT_MAX_FACTORS
    items = [values] if isinstance(values, (int, float, str)) else list(values)
    out: list[float] = []
    for item in items:
        for part in (str(item).split(",") if isinstance(item, str) else [item]):
            if isinstance(part, str) and not part.strip():
                continue
            try:
                value = float(part)
            except ValueError:
                raise FlatbenchError(f"--max-factor takes numbers larger than 1, got {part!r}") from None
            if not value > 1 or not math.isfinite(value):
                raise FlatbenchError(f"--max-factor must be larger than 1, got {value:g}")
            out.append(value)
    if not out:
        raise FlatbenchError("--max-factor: no factor range given")
    return tuple(dict.fromkeys(out))


def _settings_signature(cfg: Any) -> dict[str, Any]:
    """The measure config as a run's audit signature records it (planned once for every run)."""
    measure = dataclasses.asdict(cfg)
    for key, default in (("plugins", []), ("hvp_mode", "auto")):  # absent at their default: earlier audits
        if measure.get(key) in (default, tuple(default) if isinstance(default, list) else default):
            measure.pop(key, None)
    if cfg.plugins:  # an edited plugin makes its rows stale
        measure["plugin_sha256"] = sorted({str(s.origin_sha256) for s in all_measures().values()
                                           if s.origin != "builtin"})
    if losses := [s["sha256"] for s in map(loss_source, cfg.losses) if s]:  # and so does an edited loss file
        measure["loss_sha256"] = losses  # (`losses.loss_source`, what the measure stage's `up_to_date` compares)
    return measure


def _signature(measure: dict[str, Any], family: str, model_sha256: Any) -> str:
    """What a run's audit rows depend on besides (measure, range, draw): the measure config
    (`_settings_signature`, with the sources of plugins and loss files), the family and the model file. Rows of an
    earlier audit are reused only when it matches."""
    text = json.dumps({"measure": measure, "family": family, "model": model_sha256}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _previous_rows(path: Path) -> pd.DataFrame | None:
    """The rows of an earlier (or interrupted) population audit in the new format, else None."""
    if not path.is_file():
        return None
    try:
        frame = pd.read_csv(path, dtype={"signature": str, "note": str})
    except (OSError, ValueError, pd.errors.ParserError):
        return None
    return frame if set(POPULATION_COLUMNS) <= set(frame.columns) else None


def _reusable(previous: pd.DataFrame | None, run_id: str, signature: str,
              plan: set[tuple[str, float, int]]) -> list[dict[str, Any]] | None:
    """A run's finished rows from an earlier audit when they cover the whole plan with the same signature."""
    if previous is None:
        return None
    part = previous[(previous["run_id"] == run_id) & (previous["signature"].astype(str) == signature)]
    keyed = {(str(r["measure"]), float(r["max_factor"]), int(r["draw"])): r for r in part.to_dict(orient="records")}
    if part.empty or not plan <= set(keyed):
        return None
    return [{**keyed[key], "note": "" if pd.isna(keyed[key].get("note")) else keyed[key]["note"]}
            for key in sorted(plan, key=lambda k: (k[1], k[2]))]


def _note(record: dict[str, Any]) -> str:
    return "" if record.get("status") == "ok" else str(record.get("reason") or record.get("error") or "")


CORRELATION_COLUMNS = ["measure", "family", "max_factor", "n_draws", "n_draws_ok", "n", "tau_original", "p_original",
                       "tau_mean", "delta_mean", "delta_min", "delta_max", "delta_absmax", "p_transformed_max"]
DRAW_COLUMNS = ["measure", "family", "max_factor", "draw", "n", "tau_original", "tau_transformed", "delta",
                "p_transformed", "declared_invariant"]


def population_correlations(per_run: pd.DataFrame, entries: list[Entry], family: str,
                            max_factors: tuple[float, ...], draws: int,
                            larger_is_sharper: Callable[[str], bool]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """From the per-run rows: one row per (measure, range) with the distribution of Δτ over the draws
    (audit_correlations.csv), and one row per (measure, range, draw) (audit_draws.csv). Every τ and p is
    the report's (`analysis.stats.kendall_tests`), all asked for in one call so that the copies over the
    same runs are tested together."""
    pairs = []  # per entry: the untransformed (values, gap), then each range's draws in order
    for entry in entries:
        part = per_run[per_run["measure"] == entry.key]
        sign = 1.0 if larger_is_sharper(entry.name) else -1.0
        first = part.drop_duplicates("run_id")
        pairs.append((first["original"].to_numpy(dtype=float) * sign, first["gap"].to_numpy(dtype=float)))
        for factor in max_factors:
            for draw in range(draws):
                sel = part[(part["max_factor"].astype(float) == factor) & (part["draw"].astype(int) == draw)]
                pairs.append((sel["transformed"].to_numpy(dtype=float) * sign, sel["gap"].to_numpy(dtype=float)))
    tests = iter(kendall_tests(pairs))
    rows, draw_rows = [], []
    for entry in entries:
        part = per_run[per_run["measure"] == entry.key]
        tau0, p0, n0 = next(tests)
        declared = declared_invariant(entry.name, family)
        for factor in max_factors:
            in_range, got = part[part["max_factor"].astype(float) == factor], [next(tests) for _ in range(draws)]
            taus = [tau for tau, _, _ in got]
            delta = [tau - tau0 if math.isfinite(tau) and math.isfinite(tau0) else math.nan for tau in taus]
            draw_rows += [dict(zip(DRAW_COLUMNS, (entry.key, family, factor, d, n, tau0, tau, delta[d], p, declared)))
                          for d, (tau, p, n) in enumerate(got)]
            row = dict(zip(CORRELATION_COLUMNS, (entry.key, family, factor, draws, 0, min([n0] + [n for *_, n in got]),
                                                 tau0, p0)))
            rows.append({**row, **_draw_summary(taus, [p for _, p, _ in got], delta, tau0), "median_rel_change":
                         _median(in_range["rel_change"].to_numpy(dtype=float)), "declared_invariant": declared,
                         **_copy_status(in_range)})
    columns = [*CORRELATION_COLUMNS, *[f"tau_draw_{d}" for d in range(draws)], "median_rel_change",
               "declared_invariant", "status", "note"]
    return pd.DataFrame(rows, columns=columns), pd.DataFrame(draw_rows, columns=DRAW_COLUMNS)


def _median(values: np.ndarray) -> float:
    return float(np.nanmedian(values)) if np.isfinite(values).any() else math.nan


def _draw_summary(taus: list[float], ps: list[float], delta: list[float], tau0: float) -> dict[str, Any]:
    """A (measure, range) row's τ and Δτ over the draws: a missing τ or Δτ is NaN, never 0; `status` ok,
    partial (some draws have no τ), no_transformed (none has) or no_original (no untransformed τ)."""
    ok, deltas = [t for t in taus if math.isfinite(t)], np.array([d for d in delta if math.isfinite(d)])
    status = "no_original" if not math.isfinite(tau0) else "no_transformed" if not ok else \
        "partial" if len(ok) < len(taus) else "ok"
    spread = {f"delta_{k}": float(f(deltas)) if deltas.size else math.nan
              for k, f in (("mean", np.mean), ("min", np.min), ("max", np.max))}
    return {"n_draws_ok": len(ok), "tau_mean": float(np.mean(ok)) if ok else math.nan, **spread,
            "delta_absmax": float(np.abs(deltas).max()) if deltas.size else math.nan,
            "p_transformed_max": float(np.nanmax(ps)) if any(math.isfinite(p) for p in ps) else math.nan,
            **{f"tau_draw_{d}": tau for d, tau in enumerate(taus)}, "status": status}


def _copy_status(in_range: pd.DataFrame) -> dict[str, str]:
    """The note of a (measure, range) row: how many copies failed, by status."""
    failed = in_range[in_range["status"] != "ok"]
    counts = failed["status"].value_counts() if len(failed) else {}
    return {"note": "; ".join(f"{k} on {v} of {len(in_range)} copies" for k, v in dict(counts).items())}


def audit_population(exp_dir: Path, *, family: str = "node", measures: list[str] | None = None,
                     device: torch.device | str = "cpu", max_factor: Any = None, draws: int = DEFAULT_DRAWS,
                     gap: str | None = None, out_dir: Path | None = None, fresh: bool = False,
                     echo: Echo = print, plugins: tuple[str, ...] = (), workers: int | None = None,
                     declared_only: bool = False) -> pd.DataFrame:
    """Transform every run `draws` times for each factor range (`max_factor`: one F, several, or a comma
    list; default 2 and 100), recompute the measures on every copy and compare their correlations with
    the gap; returns the audit_correlations.csv rows. Finished runs are written as they finish
    (`SAVE_COST_RATIO`) and reused by a later call with the same settings (unless `fresh`). `workers`: runs
    audited at once, each in its own process (default: the study's `measure.workers`); every row is the one
    a lone audit gives. `declared_only`: only the entries whose measure declares invariance to the family
    (e.g. a layer-wise audit of the measures that claim layer-wise invariance, beside the node-wise audit of
    every measure)."""
    exp_dir = Path(exp_dir)
    fam, factors, draws = _checked_arguments(exp_dir, family, max_factor, draws)
    gap = gap or report_gap(exp_dir)
    gap_col = gap_column(gap)
    runs = [p for p in study_run_dirs(exp_dir) if is_finished(p)]
    if len(runs) < MIN_RUNS:
        raise FlatbenchError(f"{exp_dir} has {len(runs)} finished run(s); the population audit needs at "
                             f"least {MIN_RUNS}")
    cfg = measure_config(exp_dir, plugins)
    workers = int(workers if workers is not None else cfg.workers)
    if workers < 1:
        raise FlatbenchError(f"--workers must be at least 1, got {workers}")
    entries = plan_entries(measures, cfg)  # the plan, once: every entry and every run's context
    if declared_only:
        entries = [e for e in entries if declared_invariant(e.name, fam)]
        if not entries:
            raise FlatbenchError(f"--declared: none of the study's measures declares invariance to the {fam} family")
    contexts, settings = plan_contexts(runs, cfg), _settings_signature(cfg)
    out = Path(out_dir) if out_dir else exp_dir
    out.mkdir(parents=True, exist_ok=True)
    ranges = ", ".join(f"[1/{f:g}, {f:g}]" for f in factors)
    echo(f"population audit of {exp_dir.name}: {len(runs)} runs × {draws} {fam} transformation(s) for each "
         f"factor range {ranges} (log-uniform), {len(entries)} measure entries"
         + (f" (those declared invariant to {fam})" if declared_only else "")
         + (f", {workers} worker processes" if workers > 1 else ""))
    previous = None if fresh else _previous_rows(out / POPULATION_CSV)
    done, todo = _split_reusable(contexts, previous, settings, cfg.plugins, entries, fam, factors, draws, gap_col,
                                 device, lambda line: echo(line + f" from {out / POPULATION_CSV}"))
    store = _RunRows(out / POPULATION_CSV, done, runs, entries, echo, copies=len(factors) * draws)
    try:
        if workers > 1 and len(todo) > 1:
            run_jobs(audit_run_copies, todo, workers, torch.device(device), store.finished)
        else:
            for job in todo:
                store.finished(job, audit_run_copies(*job))
    except KeyboardInterrupt:
        store.interrupted()
        raise
    corr = _write_outputs(out, store.frame(), entries, fam, factors, draws, gap)
    echo(format_correlations(corr, gap, fam))
    computed, reused, copy_seconds = len(todo), len(runs) - len(todo), store.copy_seconds
    if computed:
        echo(f"{computed} run(s) audited in {copy_seconds:.1f}s of worker time ({copy_seconds / computed:.1f}s per "
             f"run, {copy_seconds / (computed * len(factors) * draws):.2f}s per transformed copy)"
             + (f"; {reused} reused" if reused else ""))
    echo(f"wrote {out / CORRELATIONS_CSV}, {out / CORRELATIONS_PNG}, {out / DRAWS_CSV} and "
         f"{out / POPULATION_CSV}")
    return corr


class _RunRows:
    """The audit's finished runs, by run, and their file: each run's rows are kept as they arrive and
    audit_population.csv is rewritten when a rewrite is due (`SAVE_COST_RATIO`), when the audit is
    interrupted and at the end, always in one order (the study's runs; within a run, `canonical`), so an
    interrupted and resumed audit writes the file an uninterrupted one writes."""

    def __init__(self, path: Path, done: dict[str, list[dict[str, Any]]], runs: list[Path], entries: list[Entry],
                 echo: Echo, copies: int):
        self.path, self.done, self.echo, self.copies = path, done, echo, copies
        self.order = {p.name: i for i, p in enumerate(runs)}
        self.position = {entry.key: i for i, entry in enumerate(entries)}
        self.copy_seconds, self.written, self.write_cost = 0.0, -math.inf, 0.0

    def canonical(self, row: dict[str, Any]) -> tuple:
        """A run's rows in one order however they were computed (fresh, reused after an interruption, or in
        the dtype groups of a copy): by the study's measure order, then factor range and draw."""
        return self.position.get(row["measure"], len(self.position)), str(row["measure"]), \
            float(row["max_factor"]), int(row["draw"])

    def frame(self) -> pd.DataFrame:
        rows = [r for name in sorted(self.done, key=self.order.__getitem__)
                for r in sorted(self.done[name], key=self.canonical)]
        return pd.DataFrame(rows, columns=POPULATION_COLUMNS)

    def finished(self, job: tuple, result: tuple[list[dict[str, Any]], float]) -> None:
        """A run's rows arrived (from a worker or in process): keep them, say so, rewrite the file if due."""
        rows, seconds = result
        name = job[0].target.run_path.name
        self.done[name] = rows
        self.copy_seconds += seconds
        self.echo(f"  [{self.order[name] + 1}/{len(self.order)}] {name} ({seconds:.1f}s, "
                  f"{seconds / self.copies:.2f}s per copy)")
        start = time.monotonic()
        if start - self.written >= SAVE_COST_RATIO * self.write_cost:
            atomic_write_text(self.path, self.frame().to_csv(index=False))
            self.written = time.monotonic()
            self.write_cost = self.written - start

    def interrupted(self) -> None:
        """Keep what is finished, so the same command goes on from there."""
        if self.done:
            atomic_write_text(self.path, self.frame().to_csv(index=False))
            self.echo(f"interrupted: the {len(self.done)} finished run(s) are in {self.path}; run the same "
                      "command again to go on")


def _split_reusable(contexts: list[ContextPlan], previous: pd.DataFrame | None, settings: dict[str, Any],
                    plugins: tuple[str, ...], entries: list[Entry], fam: str, factors: tuple[float, ...],
                    draws: int, gap_col: str, device: torch.device | str, echo: Echo
                    ) -> tuple[dict[str, list[dict[str, Any]]], list[tuple]]:
    """The runs an earlier audit with the same settings finished (their rows, by run) and the jobs of the
    others (the arguments of `audit_run_copies`: plain data, planned here, that a worker process gets)."""
    plan = {(e.key, f, d) for e in entries for f in factors for d in range(draws)}
    done: dict[str, list[dict[str, Any]]] = {}
    todo: list[tuple] = []
    for i, context in enumerate(contexts, 1):
        name = context.target.run_path.name
        signature = _signature(settings, fam, context.info.get("model_sha256"))
        again = _reusable(previous, name, signature, plan)
        if again is not None:
            done[name] = again
            echo(f"  [{i}/{len(contexts)}] {name}: reused")
        else:
            todo.append((context, tuple(plugins), entries, fam, factors, draws, gap_col, signature, str(device)))
    return done, todo


def audit_run_copies(context: ContextPlan, plugins: tuple[str, ...], entries: list[Entry], fam: str,
                     factors: tuple[float, ...], draws: int, gap_col: str, signature: str, device: str
                     ) -> tuple[list[dict[str, Any]], float]:
    """One run's population-audit rows and the seconds they took; a module-level function, so that a worker
    process can run it (it loads the study's measure plugins first: a worker starts without them, and the
    measures' specs, which hold functions, do not travel)."""
    t0 = time.perf_counter()
    load_plugins(plugins)
    rows = _audit_one_run(context, entries, fam, factors, draws, gap_col, signature, device)
    return rows, time.perf_counter() - t0


def _checked_arguments(exp_dir: Path, family: str, max_factor: Any, draws: int
                       ) -> tuple[str, tuple[float, ...], int]:
    """(the one family, the factor ranges, the draws) of a population audit, or one error line."""
    if not (exp_dir / "runs").is_dir():
        raise FlatbenchError(f"{exp_dir} is not a flatbench experiment folder (no runs/ inside)")
    fams = parse_families(family)
    if len(fams) != 1:
        raise FlatbenchError(f"--family takes one family for the population audit, got {family!r}")
    factors = parse_max_factors(max_factor)
    if not int(draws) >= 1:
        raise FlatbenchError(f"--draws must be at least 1, got {draws}")
    return fams[0], factors, int(draws)


def _write_outputs(out: Path, per_run: pd.DataFrame, entries: list[Entry], fam: str, factors: tuple[float, ...],
                   draws: int, gap: str) -> pd.DataFrame:
    """Write audit_population.csv, audit_correlations.csv/.png and audit_draws.csv; returns the
    correlations."""
    atomic_write_text(out / POPULATION_CSV, per_run.to_csv(index=False))
    corr, per_draw = population_correlations(per_run, entries, fam, factors, draws,
                                             lambda name: get_measure(name).larger_is_sharper)
    atomic_write_text(out / CORRELATIONS_CSV, corr.to_csv(index=False))
    atomic_write_text(out / DRAWS_CSV, per_draw.to_csv(index=False))
    atomic_write_bytes(out / CORRELATIONS_PNG, audit_correlations_figure(corr, gap, fam))
    return corr


def _stored_original(stored: dict[str, Any], entry: Entry, info: dict[str, Any]) -> dict[str, Any] | None:
    """The run's measures.json entry of `entry` where it is the untransformed value the audit would compute:
    an ok value of the same settings (e.g. not before a Monte-Carlo `rtol` was set in the study),
    measurement context, model file and loss file (`measures.runner.up_to_date`, the measure stage's own rule)."""
    record = stored.get(entry.key, {})  # (measures.json's entries as read_entries reads them: dicts)
    ok = record.get("status") == "ok" and entry.key in record.get("values", {})
    return record if ok and up_to_date(record, get_measure(entry.name), entry.settings, entry.context,
                                       info.get("model_sha256"), entry.loss) else None


def _audit_one_run(context: ContextPlan, entries: list[Entry], fam: str, factors: tuple[float, ...], draws: int,
                   gap_col: str, signature: str, device: torch.device | str) -> list[dict[str, Any]]:
    """Every (range, draw) copy of one run, in one pass (the module's docstring says how): the run is loaded
    once and its untransformed values read (or computed) once."""
    run_path, info = context.target.run_path, context.info
    stored, _ = read_entries(context.target)  # as the measure stage reads it
    ctx = load_context(context, torch.device(device))
    verdict = applicable_families(ctx.model)[fam]
    if verdict is not True:
        raise FlatbenchError(f"{run_path.name}: the {fam} family does not apply ({verdict}); choose another --family")
    gap_value = float(info.get(gap_col, float("nan")))
    originals: dict[str, tuple[dict[str, Any], str]] = {}
    for entry in entries:
        original = _stored_original(stored, entry, info)
        originals[entry.key] = (original, "measures.json") if original else (measure_entry(ctx, entry), "computed")
    rows = []
    for factor in factors:
        for draw in range(draws):
            sub = load_context(context.rescaled(population_rescaling(ctx.run_id, fam, factor, draw)), ctx.device, ctx)
            for entry in entries:
                (original, source), v0 = originals[entry.key], headline(originals[entry.key][0], entry.key)
                record = measure_entry(sub, entry) if original.get("status") == "ok" else {
                    "status": "no_original", "reason": f"untransformed: {original.get('status')} ({_note(original)})"}
                v1 = headline(record, entry.key)
                rows.append(dict(zip(POPULATION_COLUMNS, (
                    run_path.name, entry.key, fam, factor, draw, v0, v1, rel_change(v0, v1), gap_value,
                    record["status"], _note(record), source, sub.cache[FUNCTION_CHANGE], record.get("seconds", 0.0),
                    signature))))
            del sub
    return rows
