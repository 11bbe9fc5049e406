"""Computing measures on a trained model and caching each result in its measures.json.

A *target* is one trained model: a run's final model.pt or one of its snapshots (`train.snapshot_losses`),
each with its own measures.json. Each measure (and each loss of a loss-based measure) is one entry. An
entry is written to disk as soon as it is computed, so an interrupted measure stage keeps what it
finished; re-running skips entries that are there, unless they were computed with other settings or on
another measurement set (`context`), which would mix two definitions in one report: those are recomputed.
`force` recomputes everything. Failed entries are retried. A failing measure is recorded with its error
and the others go on; a model that cannot be loaded at all gets its error in every pending entry.

Each entry is one `evaluate.evaluate` (the measure isolated from the others: one that changes the model is
an error entry and the model is put back; a value is a finite real number, `non_finite` otherwise; a time
limit, `measure.timeout_s`).

Each entry also records the measure's direction (`larger_is_sharper`), so that the analysis reads it from
the files instead of the registry.

A damaged measures.json (cut off by a full disk or a killed copy) is not thrown away: its readable entries
are kept, the rest recomputed, and the damaged file is kept beside it as `measures.json.damaged`.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flatbench.config import MeasureConfig, RunConfig, run_config_from_dict
from flatbench.curvature import hvp_mode_of, use_hvp_mode
from flatbench.data import load_dataset, measurement_subset
from flatbench.errors import FlatbenchError, did_you_mean
from flatbench.losses import loss_source
from flatbench.measures.context import MeasureContext
from flatbench.measures.evaluate import evaluate, plugin_record
from flatbench.measures.keys import entry_keys
from flatbench.measures.registry import MeasureSpec, get_measure, load_plugins
from flatbench.measures.shared import prime_hessian_diagonals
from flatbench.measures.targets import Rescaling, Target, as_target, model_hash, not_a_file, read_entries
from flatbench.models import load_model
from flatbench.locks import folder_lock
from flatbench.rescale import checked_transform
from flatbench.seeding import make_generator
from flatbench.store import atomic_write_json, is_finished, load_run_info

DTYPES = {"float64": torch.float64, "float32": torch.float32}
DONE = ("ok", "not_applicable")
FAILED = ("error", "non_finite", "not_converged")
"""Entry statuses that count as failed (the stage exits with 1): `not_converged` is an iterative estimate
that stopped at its cap before its tolerance (the reason gives the residual; more iterations fix it)."""
FUNCTION_TOL = {torch.float64: 1e-8, torch.float32: 1e-3}
"""Largest relative change of the logits accepted as 'the same function' for a rescaled copy (per dtype)."""
FUNCTION_CHANGE = ("function_change",)
"""A rescaled copy's cache key of its logits' relative change (`rescale.function_change`), which the audits record."""


def _plugin_hash(record: Any) -> Any:
    """What decides whether a plugin result is current: its plugin's source hash (not where the file lies,
    so a study moved to another machine keeps its results); None for a built-in measure."""
    return record.get("sha256", "unknown") if isinstance(record, dict) else record


def check_settings(names: list[str], cfg: MeasureConfig) -> None:
    """Unknown measures or settings in `measure.settings`, a value of another type than the setting's
    default, and a value the measure's own `check` refuses are one clear error, before any work."""
    for name, given in cfg.settings.items():
        spec = get_measure(name)
        if spec.base:
            raise FlatbenchError(f"measure.settings.{name}: give settings for '{spec.base}' (a variant is a "
                                 "fixed preset of its settings)")
        if not isinstance(given, dict):
            raise FlatbenchError(f"measure.settings.{name} must be a mapping of setting: value, got {given!r:.60}")
        unknown = sorted(set(given) - set(spec.defaults))
        if unknown:
            valid = ", ".join(sorted(spec.defaults)) or "none"
            raise FlatbenchError(f"unknown setting '{unknown[0]}' for measure '{name}'"
                                 f"{did_you_mean(unknown[0], spec.defaults)} (valid: {valid})")
        for key, value in given.items():
            _check_type(name, key, value, spec.defaults[key])
    for name in names:
        spec = get_measure(name)
        if spec.check is not None:
            spec.check(spec.settings(cfg.settings))


def _check_type(name: str, key: str, value: Any, default: Any) -> None:
    """A setting's value has its default's type (an integer where a float is expected is fine; a bool is
    never a number; a None default takes anything)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = (default is None or (isinstance(default, bool) and isinstance(value, bool))
          or (isinstance(default, int) and not isinstance(default, bool) and number and float(value).is_integer())
          or (isinstance(default, float) and number) or (isinstance(default, str) and isinstance(value, str))
          or (isinstance(default, (list, tuple)) and isinstance(value, (list, tuple))))
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(type(default),
                                                                                                  "a list")
        raise FlatbenchError(f"measure.settings.{name}.{key}: expected {kind} (default {default!r}), got {value!r:.60}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FlatbenchError(f"measure.settings.{name}.{key}: expected a finite number, got {value!r}")


def entry_dtype(dtype: str, spec: MeasureSpec) -> str:
    """The dtype one measure is computed in under `measure.dtype` = `dtype`: auto gives the measure's own
    `precision` (float64 for exact quantities and solvers, float32 for the estimates registered so)."""
    return spec.precision if dtype == "auto" else dtype


def measurement_context(cfg: MeasureConfig, spec: MeasureSpec | None = None) -> dict[str, Any]:
    """What, besides a measure's own settings, its value depends on: recorded with every entry (the dtype
    is the one that measure is computed in, `entry_dtype`)."""
    dtype = entry_dtype(cfg.dtype, spec) if spec is not None else cfg.dtype
    return {"n_examples": cfg.n_examples, "dtype": dtype, "normalized_ce_tau": cfg.normalized_ce_tau}


def as_measured(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inputs or targets in the measure dtype: floating point ones converted, integer ones (token ids, class
    labels) left as they are."""
    return t.to(dtype) if t.is_floating_point() else t


def _measurable(model: Any, hvp_mode: str) -> Any:
    """`model` as every context holds it: gradients on (the measures differentiate it), its HVP mode set."""
    for p in model.parameters():
        p.requires_grad_(True)
    use_hvp_mode(model, hvp_mode)
    return model


def context_in(ctx: MeasureContext, dtype: str) -> MeasureContext:
    """`ctx` in `dtype` (float64 | float32): ctx itself when it is in that dtype, else a twin of it (the
    same model converted, the same measurement set) made once per context and kept in its cache. The twin
    has a cache of its own: a quantity computed in one dtype is never handed to a measure of the other."""
    wanted = DTYPES[dtype]
    if ctx.dtype == wanted:
        return ctx
    key = ("dtype_twin", dtype)
    if key not in ctx.cache:
        model = _measurable(copy.deepcopy(ctx.model).to(wanted).eval(), hvp_mode_of(ctx.model))
        ctx.cache[key] = replace(ctx, model=model, inputs=as_measured(ctx.inputs, wanted),
                                 targets=as_measured(ctx.targets, wanted), cache={})
    return ctx.cache[key]


@dataclass(frozen=True)
class ContextPlan:
    """How one trained model is loaded into a measure context, planned from the measure config once (its
    run.json read and its identity checked): plain data, so that it travels to a worker process."""
    target: Target
    run_cfg: RunConfig
    dtype: str
    """float64 | float32: `measure.dtype` auto loads in float64 (float32 twins are made on demand)."""
    hvp_mode: str
    n_examples: int | None
    normalized_ce_tau: float
    chunk_size: int
    max_memory_mb: int

    @property
    def info(self) -> dict[str, Any]:
        """The run's run.json as the plan read it."""
        return self.target.info or {}

    def rescaled(self, rescaling: Rescaling | None) -> ContextPlan:
        """The plan of a rescaled copy of this model (`Target.rescaling`)."""
        return replace(self, target=replace(self.target, rescaling=rescaling))


def plan_context(target: Target | Path, cfg: MeasureConfig) -> ContextPlan:
    """The plan of one model's context: its run.json read (once, unless the target carries it) and checked
    against its folder, and what the measure config decides of the context."""
    target = as_target(target)
    info = target.info if target.info is not None else load_run_info(target.run_path)
    run_cfg: RunConfig = run_config_from_dict(info["config"])
    if run_cfg.run_id() != target.run_path.name:
        raise FlatbenchError(f"{target.run_path / 'run.json'} describes run {run_cfg.run_id()}, not "
                             f"{target.run_path.name} (edited by hand?); move the folder away or retrain it")
    return ContextPlan(replace(target, info=info), run_cfg, "float32" if cfg.dtype == "float32" else "float64",
                       cfg.hvp_mode, cfg.n_examples, cfg.normalized_ce_tau, cfg.chunk_size, cfg.max_memory_mb)


def plan_contexts(targets: list[Target | Path], cfg: MeasureConfig) -> list[ContextPlan]:
    """The context plans of several models, all planned at once before any is loaded."""
    return [plan_context(target, cfg) for target in targets]


def load_context(plan: ContextPlan, device: torch.device, base: MeasureContext | None = None) -> MeasureContext:
    """Load a planned model (final or snapshot, its hash checked) and its measurement set. A rescaled copy
    (`Target.rescaling`) is the model as trained, `base` when given (so a run's copies share one load and its
    random draws), transformed in a fresh cache, its function checked (`rescale.checked_transform`, to
    `FUNCTION_TOL`; the change is kept under `FUNCTION_CHANGE`): so nothing computed on one copy is reused."""
    target, run_cfg, dtype = plan.target, plan.run_cfg, DTYPES[plan.dtype]
    if target.rescaling is not None:
        base, r = base or load_context(plan.rescaled(None), device), target.rescaling
        model, change = checked_transform(base.model, r.family, make_generator(*r.seed), 1 / r.max_factor,
                                          r.max_factor, base.inputs, FUNCTION_TOL.get(base.dtype, 1e-3), target.label,
                                          base.chunk_size, f"the tolerance of {str(base.dtype)[6:]}: measure in "
                                          "float64 or lower --max-factor")
        return replace(base, model=_measurable(model, hvp_mode_of(base.model)), cache={FUNCTION_CHANGE: change})
    model_file = None if target.level is None else target.model_file
    model = load_model(target.run_path, device=device, model_file=model_file, sha256=target.sha256, info=plan.info)
    model = _measurable(model.to(dtype).eval(), plan.hvp_mode)
    ds = load_dataset(run_cfg.data, run_cfg.data_seed, device=device)
    x, y = measurement_subset(ds, plan.n_examples, run_cfg.seed)
    return MeasureContext(model=model, inputs=as_measured(x, dtype), targets=y, num_classes=ds.num_classes,
                          run_id=plan.info["run_id"], seed=run_cfg.seed, normalized_ce_tau=plan.normalized_ce_tau,
                          chunk_size=plan.chunk_size, max_memory_mb=plan.max_memory_mb,
                          model_config=run_cfg.model)


def build_context(target: Target | Path, cfg: MeasureConfig, device: torch.device) -> MeasureContext:
    """Load a finished run's model (final or snapshot, its hash checked) and its measurement set: its
    context planned (`plan_context`) and loaded (`load_context`)."""
    return load_context(plan_context(target, cfg), device)


def compute_entry(ctx: MeasureContext, spec: MeasureSpec, settings: dict[str, Any],
                  loss: str | None, timeout_s: float | None = None) -> dict[str, Any]:
    """One measure for one loss as a measures.json entry: `evaluate.evaluate`'s record (guarded, limited to
    `timeout_s`, HVPs logged) in its stored form. A FlatbenchError of the measure (the user's input, such as
    a loss file that cannot be loaded) stops the caller with its one clear line."""
    record = evaluate(ctx, spec, settings, loss, timeout_s)
    if isinstance(record.exception, FlatbenchError):
        raise record.exception
    return record.entry()


def up_to_date(record: dict[str, Any], spec: MeasureSpec, settings: dict[str, Any], context: dict[str, Any],
                model_sha256: str | None = None, loss: str | None = None) -> bool:
    """The one rule for whether a stored entry is current (the measure stage's `todo_entries`, the population
    audit's untransformed values): computed with these settings and measurement context, on this model file (not
    a retrained run's), with the plugin source and the loss `loss` (`same_loss`) as they are now."""
    if record.get("status") not in DONE or _plugin_hash(record.get("plugin")) != _plugin_hash(plugin_record(spec)):
        return False
    if model_sha256 is not None and record.get("model_sha256") != model_sha256 or not same_loss(record, loss):
        return False
    stored = {k: v for k, v in (record.get("settings") or {}).items() if k != "loss"}
    for key in spec.added_settings:  # stored before the setting existed: computed as its default computes
        if key not in stored and key in settings and settings[key] == spec.defaults.get(key):
            stored[key] = settings[key]
    return stored == settings and record.get("context") == context


@dataclass(frozen=True)
class PlannedMeasure:
    """One measure of a stage's plan, resolved once per stage (not per model): its spec, the settings and
    the measurement context its entries record, and its entry keys (one per loss of a loss-based measure)."""

    spec: MeasureSpec
    settings: dict[str, Any]
    context: dict[str, Any]
    keys: tuple[tuple[str | None, str], ...]


def plan_measures(names: list[str], cfg: MeasureConfig) -> tuple[PlannedMeasure, ...]:
    """The measures `names` (resolved names, `registry.resolve_names`) as the plan of a stage: the registry
    is asked once per name here, and never again while the models are measured."""
    load_plugins(cfg.plugins)
    planned = []
    for name in names:
        spec = get_measure(name)
        planned.append(PlannedMeasure(spec, spec.settings(cfg.settings), measurement_context(cfg, spec),
                                      tuple(entry_keys(name, spec, cfg.losses))))
    return tuple(planned)


def todo_entries(results: dict[str, Any], measures: tuple[PlannedMeasure, ...], force: bool, sha: str | None
                 ) -> list[tuple[MeasureSpec, str | None, str]]:
    """The (spec, loss, key) entries of `measures` that `results` (a target's measures.json) lacks or holds
    for other settings, another measurement set, model file, plugin source or loss file (`up_to_date`)."""
    return [(m.spec, loss, key) for m in measures for loss, key in m.keys
            if force or not up_to_date(results.get(key, {}), m.spec, m.settings, m.context, sha, loss)]


def same_loss(record: dict[str, Any], loss: str | None) -> bool:
    """Whether a stored entry was computed with the loss `loss` as it is now: a loss of one's own by its file's
    sha256 (`losses.loss_source`; not by its name, which two files may share, nor by where the file lies)."""
    now = loss_source(loss)
    stored = record.get("loss_source")
    return now is None or isinstance(stored, dict) and stored.get("sha256") == now["sha256"]


def pending_entries(target: Target | Path, names: list[str], cfg: MeasureConfig, force: bool = False, *,
                    results: dict[str, Any] | None = None
                    ) -> tuple[dict[str, Any], list[tuple[MeasureSpec, str | None, str]]]:
    """A target's measures.json content and the (spec, loss, key) entries still to compute (one target on
    its own; a stage plans every target at once: `plan_target`). `results`: the target's entries when the
    caller has just read them (measures.json is then not read again)."""
    if results is None:
        results, _ = read_entries(target)
    return results, todo_entries(results, plan_measures(names, cfg), force, model_hash(target))


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells whether a file changed since it was read: its modification time and size."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@dataclass
class TargetPlan:
    """One model's part of a stage's plan: its measures.json as read when the stage planned, and the
    entries still to compute. Computing it (under the folder's lock) re-reads the file only if another
    process wrote it since (`current`)."""

    target: Target
    measures: tuple[PlannedMeasure, ...]
    force: bool
    results: dict[str, Any]
    damaged: str | None
    """Why measures.json was damaged (its readable entries are `results`), or None."""
    unusable: str | None
    """Why measures.json is no file at all (a folder, a link to /dev/null): never overwritten."""
    sha: str | None
    todo: list[tuple[MeasureSpec, str | None, str]]
    stamp: tuple[int, int] | None

    def planned(self, spec: MeasureSpec) -> PlannedMeasure:
        """The plan's entry of measure `spec` (its settings and measurement context)."""
        return next(m for m in self.measures if m.spec.name == spec.name)

    def current(self) -> TargetPlan:
        """This plan, or a new one of the same target when its measures.json changed since it was read."""
        if _stamp(self.target.measures_file) == self.stamp:
            return self
        return plan_target(self.target, self.measures, self.force)


def plan_target(target: Target | Path, measures: tuple[PlannedMeasure, ...], force: bool = False) -> TargetPlan:
    """Read a target's measures.json once and list what is still to compute."""
    target = as_target(target)
    path = target.measures_file
    stamp = _stamp(path)
    unusable = not_a_file(path)
    results, damaged = ({}, None) if unusable else read_entries(target)
    sha = model_hash(target)
    return TargetPlan(target, measures, force, results, damaged, unusable, sha,
                      todo_entries(results, measures, force, sha), stamp)


@dataclass
class MeasureReport:
    """What `measure_run` did on one target."""

    entries: int
    errors: int
    failure: str | None = None
    """Why the model could not be measured at all (its entries then hold this error)."""
    damaged: str | None = None
    """The damaged measures.json that was repaired (its readable entries kept)."""
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    """(model label, entry key, reason) of each entry that failed (error or non_finite) in this pass."""


def format_value(value: Any) -> str:
    """A measure value for people: 4 significant digits."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def measure_run(target: Target | Path, names: list[str], cfg: MeasureConfig, device: torch.device,
                force: bool = False, echo: Callable[[str], None] | None = None,
                ctx: MeasureContext | None = None, on_entry: Callable[[str, str], None] | None = None
                ) -> MeasureReport:
    """Compute the missing measures of one finished run's model (final or snapshot) on its own: plan it
    (`plan_target`) and compute the plan (`measure_planned`). A stage plans all its models first."""
    target = as_target(target)
    if not is_finished(target.run_path):
        raise FlatbenchError(f"run {target.run_path.name} has not finished training; run `flatbench train` first")
    return measure_planned(plan_target(target, plan_measures(names, cfg), force), cfg, device, echo=echo, ctx=ctx,
                           on_entry=on_entry)


def measure_planned(plan: TargetPlan, cfg: MeasureConfig, device: torch.device,
                    echo: Callable[[str], None] | None = None, ctx: MeasureContext | None = None,
                    on_entry: Callable[[str, str], None] | None = None) -> MeasureReport:
    """Compute one model's pending entries and store each in its measures.json as soon as it is computed.
    The caller holds the folder's lock; `plan` is re-read only if another process wrote the file since.

    `ctx`: an already built context of this target (e.g. with group-computed quantities in its cache).
    `on_entry(label, key)` is called after each entry (a progress bar).
    """
    plan = plan.current()
    target, path = plan.target, plan.target.measures_file
    report = MeasureReport(entries=len(plan.results), errors=0)
    if plan.unusable:  # a folder or a link to /dev/null: named, never overwritten, the other runs go on
        report.failure = f"{path} is damaged ({plan.unusable}); remove it and run `flatbench measure` again"
        report.errors = len(plan.todo)
        return report
    results = plan.results
    if plan.damaged:
        report.damaged = str(path)
        shutil.copyfile(path, path.with_name(path.name + ".damaged"))
        atomic_write_json(path, results)
        if echo:
            echo(f"warning: {path} was damaged ({plan.damaged}); kept its {len(results)} readable entries (the "
                 f"damaged file is kept as {path.name}.damaged) and recomputing the rest")
    if not plan.todo:
        return report
    if ctx is None:
        try:
            ctx = build_context(target, cfg, device)
        except FlatbenchError as exc:
            _record_unloadable(plan, exc, report)
            atomic_write_json(path, results)
            if echo:
                echo(f"  {target.label}: cannot be measured: {exc}")
            return report
    for spec, loss, key in plan.todo:
        planned = plan.planned(spec)
        record = compute_entry(context_in(ctx, entry_dtype(cfg.dtype, spec)), spec, planned.settings, loss,
                               cfg.timeout_s)
        record["context"] = planned.context
        record["model_sha256"] = plan.sha
        results[key] = record
        atomic_write_json(path, results)
        if record["status"] in FAILED:
            report.errors += 1
            report.failed.append((target.label, key, entry_reason(record)))
        if on_entry:
            on_entry(target.label, key)
        if echo:
            echo(_entry_line(target.label, key, record))
    report.entries = len(results)
    return report


GROUP_SIZE = 16
"""Runs whose Hessian diagonals are computed together (`measure.group_runs`)."""


def measure_plans(plans: list[TargetPlan], cfg: MeasureConfig, device: torch.device, *,
                  done: Callable[[Target, MeasureReport, float], None], echo: Callable[[str], None] | None = None,
                  on_entry: Callable[[str, str], None] | None = None) -> None:
    """The compute loop of a stage's plan, in this process: each model under its folder's lock
    (`locks.folder_lock`), `done(target, report, seconds)` after each. Same-architecture MLPs get their
    Hessian diagonals computed as groups where `measure.group_runs` asks (`grouped_contexts`). A model that
    another process holds is measured after the others, on what that process wrote."""
    use_groups = cfg.group_runs == "on" or (cfg.group_runs == "auto" and device.type == "cuda")
    step = GROUP_SIZE if use_groups else 1
    busy: list[TargetPlan] = []

    def measure_one(plan: TargetPlan, ctx: MeasureContext | None, blocking: bool) -> bool:
        t0 = time.perf_counter()
        try:
            with folder_lock(plan.target.where, blocking=blocking) as held:
                if not held:
                    return False
                report = measure_planned(plan, cfg, device, echo=echo, ctx=ctx, on_entry=on_entry)
        except OSError as exc:  # this model's files: its failure named, the other models measured
            report = io_failure(plan.target, exc, len(plan.todo), echo)
        done(plan.target, report, time.perf_counter() - t0)
        return True

    for start in range(0, len(plans), step):
        batch = plans[start:start + step]
        contexts = grouped_contexts(batch, cfg, device) if use_groups else {}
        for plan in batch:
            if not measure_one(plan, contexts.pop(plan.target, None), blocking=False):
                busy.append(plan)  # another process measures it now: after the others, on what it wrote
    for plan in busy:
        measure_one(plan, None, blocking=True)


def io_failure(target: Target, exc: OSError, pending: int, echo: Callable[[str], None] | None = None
               ) -> MeasureReport:
    """A model whose files could not be read or written (an unreadable model.pt, a read-only run folder, a
    full disk): a failed model, named at the end of the stage (exit 2), the stage going on with the others."""
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    reason = f"{exc.strerror or exc}{where}"
    if echo:
        echo(f"  {target.label}: cannot be measured: {reason}")
    return MeasureReport(entries=0, errors=pending, failure=reason)


def grouped_contexts(plans: list[TargetPlan], cfg: MeasureConfig, device: torch.device) -> dict:
    """Contexts of the models that still need a curvature measure, with the exact Hessian diagonals of
    same-architecture MLPs computed as groups (`flatbench.measures.shared.prime_hessian_diagonals`); the
    others are measured as usual."""
    contexts = {}
    for plan in plans:
        if any(spec.cost == "hessian" for spec, _, _ in plan.todo):
            try:
                contexts[plan.target] = build_context(plan.target, cfg, device)
            except (FlatbenchError, OSError):
                continue  # measured alone, where the error is recorded
    prime_hessian_diagonals(list(contexts.values()), cfg.losses)
    return contexts


def _record_unloadable(plan: TargetPlan, exc: FlatbenchError, report: MeasureReport) -> None:
    """A model that cannot be loaded: its error in every pending entry (a value computed before the model
    was damaged is kept, not replaced by an error)."""
    report.failure = str(exc)
    for spec, _, key in plan.todo:
        report.errors += 1
        if plan.results.get(key, {}).get("status") in DONE:
            continue
        plan.results[key] = {"status": "error", "error": f"the model could not be loaded: {exc}",
                             "settings": plan.planned(spec).settings, "larger_is_sharper": spec.larger_is_sharper,
                             "context": plan.planned(spec).context, "seconds": 0.0}


def entry_reason(record: dict[str, Any]) -> str:
    """The first line of a failed or not-applicable entry's reason."""
    text = str(record.get("reason") or record.get("error") or "")
    return text.splitlines()[0] if text else ""


def _entry_line(label: str, key: str, record: dict[str, Any]) -> str:
    """One line per entry; a not-applicable reason or an error goes on its own short line below."""
    status = record["status"]
    head = f"  {label}  {key:34s} "
    if status == "ok":
        return f"{head}{format_value(record['values'].get(key)):>11}  ({record['seconds']:.2f}s)"
    return f"{head}{status.replace('_', ' ')}\n      {entry_reason(record)[:150]}"
