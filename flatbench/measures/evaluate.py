"""One evaluation of one measure: the only place the package calls a measure's function.

The measure stage (`runner.compute_entry`), `flatbench.measure_model`, the audits and the invariance contract
(`contract.run_measure`) all evaluate here, so a value means the same wherever it was computed: guarded
(`isolation.guarded_call`: a change of the model, the measurement set or the process is put back and is an
error), time-limited, its Hessian-vector products logged. The stage stores the `Record`'s `entry()`; the
contract judges its raw `output` or `exception` (a NaN, say), not the entry made of it.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatbench.curvature import hvp_log
from flatbench.losses import BUILTIN_LOSSES, loss_source
from flatbench.measures.context import MeasureContext
from flatbench.measures.isolation import MeasureTimeout, guarded_call, known_code, measurement_data, time_limit
from flatbench.measures.keys import value_key
from flatbench.measures.process_state import OutsideChange, ProcessExitRefused
from flatbench.measures.registry import MeasureOutput, MeasureOutputError, MeasureSpec, NotApplicable, as_output
from flatbench.store import json_problem


def plugin_record(spec: MeasureSpec) -> dict[str, Any] | None:
    """What a result records of a plugin measure's source (None for a built-in measure)."""
    if spec.origin == "builtin":
        return None
    return {"source": spec.origin, "sha256": spec.origin_sha256}


@dataclass
class Record:
    """The outcome of one evaluation. `status`: ok | not_applicable | non_finite | not_converged | error;
    `values` by result key (ok only; a not-converged estimate is kept in `info["values"]`)."""

    spec: MeasureSpec = field(repr=False)
    loss: str | None
    settings: dict[str, Any]
    """The settings the measure ran with (and the loss asked for, if any), as its entry records them."""
    status: str
    values: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] | None = None
    reason: str | None = None
    error: str | None = None
    where: str | None = None
    """file:line where the measure raised its error (an exception of its own code)."""
    seconds: float = 0.0
    output: MeasureOutput | None = field(default=None, repr=False)
    """The output as returned (also when not finite or not converged): what the contract judges."""
    exception: BaseException | None = field(default=None, repr=False)
    """What it raised (NotApplicable included), or the `OutsideChange` of what it changed."""

    def entry(self) -> dict[str, Any]:
        """The record as a measures.json entry (`runner.compute_entry`): its settings, direction, plugin
        source and loss file (which decide whether it is current), status and outcome, seconds."""
        out: dict[str, Any] = {"settings": self.settings, "larger_is_sharper": self.spec.larger_is_sharper}
        if plugin_record(self.spec) is not None:
            out["plugin"] = plugin_record(self.spec)
        if loss_source(self.loss) is not None:
            out["loss_source"] = loss_source(self.loss)  # an edited loss file makes the entry stale
        out["status"] = self.status
        fields = (("reason", self.reason), ("info", self.info)) if self.status == "not_converged" else (
            ("values", self.values if self.status == "ok" else None), ("info", self.info), ("reason", self.reason),
            ("error", self.error), ("where", self.where))
        out.update((k, v) for k, v in fields if v is not None)
        out["seconds"] = self.seconds
        return out


def evaluate(ctx: MeasureContext, spec: MeasureSpec, settings: dict[str, Any], loss: str | None = None,
             timeout_s: float | None = None) -> Record:
    """Run one measure for one loss (None: ce) and judge its outcome: `ok` with finite values, or
    `not_applicable`, `non_finite` (NaN or inf, with the key), `not_converged` (an iterative estimate stopped
    at its cap: the residual in the reason, the estimate in `info["values"]`) or `error` with the reason: any
    exception (a plugin's SystemExit included), a result that is not numbers, info that JSON cannot hold,
    the time limit, or a change of the model, the data or the process (put back). HVPs made are described
    in `info["hvp"]`. Raises only KeyboardInterrupt: a FlatbenchError is the record's `exception`."""
    sub = ctx.for_measure(spec.name, settings, loss_name=loss or "ce")
    record = Record(spec, loss, {**settings, **({"loss": loss} if loss else {})}, "error")
    start = time.perf_counter()
    products = None

    def call() -> Any:
        nonlocal products
        with time_limit(timeout_s, spec.name), hvp_log() as products:
            return as_output(spec.fn(sub), spec.base_name)

    known = spec.origin == "builtin" and _builtin_loss(sub) and known_code(ctx.model)
    out, exc, change = guarded_call(ctx.model, call, bitwise=not known, data=measurement_data(ctx))
    if change or isinstance(exc, OutsideChange):
        ctx.cache.clear()  # anything cached during the measure may be of the changed model, data or process
        record.error = "; ".join(([f"changed the model ({change})"] if change else [])
                                 + ([str(exc)] if isinstance(exc, OutsideChange) else []))
        record.exception = OutsideChange(record.error)
    elif exc is not None:
        record.exception = exc
        if isinstance(exc, NotApplicable):
            record.status, record.reason = "not_applicable", str(exc)
        else:
            record.error, record.where = _error_text(exc)
    else:
        record.output = out
        _judge(record, out)
        if products is not None and products.count and isinstance(record.info, dict):
            record.info = {**record.info, "hvp": products.info()}  # how its curvature was computed
        if loss is None and spec.fixed_loss and ctx.loss_name != spec.fixed_loss and record.reason is None:
            record.reason = (f"computed with {spec.fixed_loss}, the loss this measure is defined with; the "
                             f"loss asked for ({ctx.loss_name}) is not used by it")
    record.seconds = round(time.perf_counter() - start, 4)
    return record


def _builtin_loss(ctx: MeasureContext) -> bool:
    """Whether the context's loss is one of flatbench's (a function of the caller's may hold the model), told
    without loading it (a loss file is loaded inside the measure's guard, where its failure is the entry's)."""
    loss = ctx.cache.get(("loss", ctx.loss_name, ctx.normalized_ce_tau))
    return getattr(loss, "fn", None) is None if loss is not None else ctx.loss_name in BUILTIN_LOSSES


def _error_text(exc: BaseException) -> tuple[str, str | None]:
    """An error's message, and where the measure raised it (for an exception of its own code)."""
    if isinstance(exc, (MeasureTimeout, ProcessExitRefused)):
        return str(exc), None
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}): the measure tried to end the process", None
    if isinstance(exc, MeasureOutputError):
        return str(exc), None  # names the measure and what it returned; where it returned is no help
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None
    return f"{type(exc).__name__}: {exc}", where


def _judge(record: Record, out: MeasureOutput) -> None:
    """A measure's output as a status: `ok`, or `non_finite` naming the first value that is NaN or inf, or
    `error` when its info cannot be stored in JSON, or `not_converged`."""
    spec = record.spec
    values = {value_key(spec.name, spec.base_name, record.loss, key): value for key, value in out.values.items()}
    bad = [(key, value) for key, value in values.items() if not math.isfinite(value)]
    problem = None if bad else json_problem(out.info)
    if bad:
        record.status = "non_finite"
        record.reason = (f"measure '{spec.name}' gave {bad[0][0]} = {bad[0][1]}"
                         + (f" (and {len(bad) - 1} more non-finite values)" if len(bad) > 1 else ""))
    elif problem:
        record.error = f"measure '{spec.name}' returned info that JSON cannot hold ({problem})"
    elif out.not_converged:  # the estimate is kept in info, not among the values the statistics read
        record.status, record.reason = "not_converged", f"measure '{spec.name}' did not converge: {out.not_converged}"
        record.info = {**out.info, "values": values}
    else:
        record.status, record.values, record.info = "ok", values, out.info
