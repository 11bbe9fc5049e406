"""Computing measures on a trained run and caching each result in its measures.json.

Each measure (and each loss of a loss-based measure) is one entry. An entry is written to disk as soon
as it is computed, so an interrupted measure stage keeps what it finished; re-running skips entries
that are there (`force` recomputes). Entries that failed are retried. A failing measure is recorded with
its error and the others go on.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from flatbench.config import MeasureConfig, RunConfig, run_config_from_dict
from flatbench.errors import FlatbenchError
from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import MeasureOutput, MeasureSpec, NotApplicable, get_measure, resolve_names
from flatbench.store import MEASURES_JSON, atomic_write_json, is_finished, load_run_info, read_json

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def entry_key(name: str, loss: str | None) -> str:
    """measures.json key: the measure's name, with `@loss` for a loss other than `ce`."""
    return name if loss in (None, "ce") else f"{name}@{loss}"


def check_settings(names: list[str], cfg: MeasureConfig) -> None:
    """Unknown measures or settings in `measure.settings` are one clear error, before any work."""
    for name, given in cfg.settings.items():
        spec = get_measure(name)
        unknown = sorted(set(given) - set(spec.defaults))
        if unknown:
            valid = ", ".join(sorted(spec.defaults)) or "none"
            raise FlatbenchError(f"unknown setting(s) {', '.join(unknown)} for measure '{name}' "
                                 f"(valid: {valid})")


def build_context(run_path: Path, cfg: MeasureConfig, device: torch.device) -> MeasureContext:
    """Load a finished run's model and its measurement set into a fresh context."""
    from flatbench.data import load_dataset, measurement_subset
    from flatbench.train import load_model

    info = load_run_info(run_path)
    run_cfg: RunConfig = run_config_from_dict(info["config"])
    dtype = DTYPES[cfg.dtype]
    model = load_model(run_path, device=device).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    ds = load_dataset(run_cfg.data, run_cfg.seed, device=device)
    x, y = measurement_subset(ds, cfg.n_examples, run_cfg.seed)
    return MeasureContext(model=model, inputs=x.to(dtype), targets=y, num_classes=ds.num_classes,
                          run_id=info["run_id"], seed=run_cfg.seed, normalized_ce_tau=cfg.normalized_ce_tau,
                          chunk_size=cfg.chunk_size, max_memory_mb=cfg.max_memory_mb,
                          model_config=run_cfg.model)


def compute_entry(ctx: MeasureContext, spec: MeasureSpec, settings: dict[str, Any],
                  loss: str | None) -> dict[str, Any]:
    """Run one measure for one loss and turn its outcome (value, not applicable, error) into an entry."""
    sub = ctx.for_measure(spec.name, settings, loss_name=loss or "ce")
    record: dict[str, Any] = {"settings": {**settings, **({"loss": loss} if loss else {})}}
    start = time.perf_counter()
    try:
        out = spec.fn(sub)
        if not isinstance(out, MeasureOutput):
            out = MeasureOutput(dict(out))
        suffix = "" if loss in (None, "ce") else f"@{loss}"
        values = {}
        for key, value in out.values.items():
            base, _, detail = key.partition("/")
            values[f"{base}{suffix}" + (f"/{detail}" if detail else "")] = float(value)
        record.update(status="ok", values=values, info=out.info)
    except NotApplicable as exc:
        record.update(status="not_applicable", reason=str(exc))
    except FlatbenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing measure must not stop the study
        last = traceback.extract_tb(exc.__traceback__)[-1]
        record.update(status="error", error=f"{type(exc).__name__}: {exc}",
                      where=f"{Path(last.filename).name}:{last.lineno}")
    record["seconds"] = round(time.perf_counter() - start, 4)
    return record


def pending_entries(run_path: Path, names: list[str], cfg: MeasureConfig, force: bool = False
                    ) -> tuple[dict[str, Any], list[tuple[MeasureSpec, str | None, str]]]:
    """A run's measures.json content and the (spec, loss, key) entries still to compute."""
    path = Path(run_path) / MEASURES_JSON
    results: dict[str, Any] = read_json(path) if path.is_file() else {}
    todo = []
    for name in resolve_names(names):
        spec = get_measure(name)
        for loss in (cfg.losses if spec.uses_loss else (None,)):
            key = entry_key(name, loss)
            if force or results.get(key, {}).get("status") not in ("ok", "not_applicable"):
                todo.append((spec, loss, key))
    return results, todo


def measure_run(run_path: Path, names: list[str], cfg: MeasureConfig, device: torch.device,
                force: bool = False, echo: Callable[[str], None] | None = None,
                ctx: MeasureContext | None = None) -> dict[str, Any]:
    """Compute the missing measures of one finished run; returns its measures.json content.

    `ctx`: an already built context of this run (e.g. with group-computed quantities in its cache).
    """
    run_path = Path(run_path)
    if not is_finished(run_path):
        raise FlatbenchError(f"run {run_path.name} has not finished training; run `flatbench train` first")
    path = run_path / MEASURES_JSON
    results, todo = pending_entries(run_path, names, cfg, force)
    if not todo:
        return results
    ctx = ctx or build_context(run_path, cfg, device)
    for spec, loss, key in todo:
        settings = {**spec.defaults, **cfg.settings.get(spec.name, {})}
        record = compute_entry(ctx, spec, settings, loss)
        results[key] = record
        atomic_write_json(path, results)
        if echo:
            status = record["status"]
            shown = record.get("values", {}).get(key) if status == "ok" else record.get("error") or record.get("reason")
            echo(f"  {run_path.name}  {key:32s} {status:14s} {shown}  ({record['seconds']:.2f}s)")
    return results
