"""Issue 28's speed-ups of the Monte-Carlo measures, each against the slow path:

- (a) the run's random draws (`ctx.draws`: the average-case noise, the PAC-Bayes noise) are shared by every
  context of the run, so a rescaled copy measured after its run reads them instead of drawing them: its
  values are bitwise those of the copy measured alone, and nothing is drawn again;
- (c) the estimates stopped at a relative standard error (`rtol`): the stopping rule (the first round, from
  `min_samples` on, whose standard error is at most rtol × |estimate|), the standard error reported, the
  value (that of the draws used), and the default rtol = 0 keeping the fixed-size estimate (today's values).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from cases import case

from flatbench import rescale
from flatbench.config import MeasureConfig
from flatbench.measures import all_measures, shared
from flatbench.measures.builtin.pacbayes import accuracy, scale_perturbation, standard_normals
from flatbench.measures.builtin.sharpness import _mc_estimate, adaptive_average_case, average_case_logits
from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import up_to_date, compute_entry, context_in, measurement_context, pending_entries
from flatbench.study.spec import read_saved_study

MC = ("adaptive_sharpness_avg", "pacbayes_flatness", "pacbayes_mag_flatness")


@pytest.fixture(scope="module")
def mlp():
    return case("mlp")


def _context(c, model=None) -> MeasureContext:
    return MeasureContext(model=c.model if model is None else model, inputs=c.inputs, targets=c.targets,
                          num_classes=c.num_classes, run_id="draws", seed=3)


def _entry(ctx: MeasureContext, name: str, loss: str | None = None, **settings) -> dict:
    spec = all_measures()[name]
    record = compute_entry(ctx, spec, spec.settings({name: settings} if settings else None), loss)
    record.pop("seconds")
    return record


def test_normal_draws_are_the_generators_sequence_in_any_order():
    """Item i is the generator's i-th draw (float64, rounded), asked for in order, out of order, again, kept
    or not (then drawn again from the state saved before it)."""
    ctx = MeasureContext(model=torch.nn.Linear(2, 2), inputs=torch.zeros(4, 2), targets=torch.zeros(4).long(),
                         num_classes=2).for_measure("m", {})
    gen = ctx.generator("t")
    reference = [torch.randn(7, generator=gen, dtype=torch.float64).float() for _ in range(6)]
    for keep in (True, False):
        draws = shared.NormalDraws(ctx.generator("t"), 7, torch.float32, ctx.device, keep)
        for i in (3, 0, 5, 1, 1, 4, 2, 5):
            assert torch.equal(draws[i], reference[i])
        # not kept: an item asked again is drawn again from the state saved before it (3 → 0..3, 5 → 3..5)
        assert draws.drawn == (6 if keep else 4 + 1 + 3 + 1 + 1 + 1 + 1 + 1)
    assert not shared.normal_draws(dataclasses.replace(ctx, max_memory_mb=0, draws={}), "t", 6, 7, torch.float32).keep
    assert shared.normal_draws(dataclasses.replace(ctx, draws={}), "t", 6, 7, torch.float32).keep


@pytest.mark.parametrize("family,dtype", [("node", "float64"), ("layer", "float32")])
def test_a_rescaled_copy_reads_its_runs_draws_and_gets_its_lone_values(mlp, family, dtype):
    """The audit's path (the copy's context made from its run's, `dataclasses.replace` with a fresh cache:
    the draws are the run's; in float32 through the dtype twin, as the audit computes these measures)
    against the slow path (the copy in a context of its own): every entry of the Monte-Carlo measures is
    identical, values and info, and the copy draws nothing."""
    run = context_in(_context(mlp), dtype)
    for name in MC:
        _entry(run, name)
    _entry(run, "adaptive_sharpness_avg", "normalized_ce")
    drawn = {k: v.drawn for k, v in run.draws.items() if isinstance(v, shared.NormalDraws)}
    keys = set(run.draws)
    assert drawn and any(k[0] == "standard_normals" for k in keys)
    model = rescale.transform(mlp.model, family, torch.Generator().manual_seed(11), 0.1, 10.0)
    copy_ctx = context_in(dataclasses.replace(_context(mlp), model=model, cache={}, draws=run.draws), dtype)
    alone = context_in(_context(mlp, model), dtype)
    for name, loss in [(n, None) for n in MC] + [("adaptive_sharpness_avg", "normalized_ce")]:
        fast, slow = _entry(copy_ctx, name, loss), _entry(alone, name, loss)
        assert fast == slow, name
    assert set(run.draws) == keys  # nothing new drawn for the copy
    assert {k: v.drawn for k, v in run.draws.items() if isinstance(v, shared.NormalDraws)} == drawn


def test_the_average_case_stops_at_its_relative_standard_error(mlp):
    """rtol > 0: draws taken one round (a draw per batch) at a time; the estimate stops at the first round
    m ≥ min_samples whose standard error is at most rtol × |estimate|, and is the estimate of those m rounds
    of the fixed-size computation's draws; info reports m, the standard error, rtol and that it was met."""
    rho, samples, size = 0.1, 20, 16
    ctx = _context(mlp).for_measure("adaptive_sharpness_avg", {}, loss_name="ce")
    full, full_info = adaptive_average_case(ctx, rho=rho, samples=samples, batch_size=size)
    logits = average_case_logits(ctx, rho=rho, samples=samples, batch_size=size)
    weights = [int(y.shape[0]) / ctx.n for _, y in logits.batches]
    with torch.no_grad():
        diffs = [[float(ctx.loss(logits.perturbed(b, m), y)) - float(ctx.loss(logits.base(b), y))
                  for m in range(samples)] for b, (_, y) in enumerate(logits.batches)]
    assert (full, full_info["stderr"]) == _mc_estimate(diffs, weights, samples) and "rtol" not in full_info
    for rtol, min_samples in ((0.3, 3), (0.15, 5), (1e-6, 2)):
        value, info = adaptive_average_case(_context(mlp).for_measure("adaptive_sharpness_avg", {}, loss_name="ce"),
                                            rho=rho, samples=samples, batch_size=size, rtol=rtol,
                                            min_samples=min_samples)
        m = info["samples_per_batch"]
        rule = [m2 for m2 in range(min_samples, samples)
                if _mc_estimate(diffs, weights, m2)[1] <= rtol * abs(_mc_estimate(diffs, weights, m2)[0])]
        assert m == (rule[0] if rule else samples)
        assert (value, info["stderr"]) == _mc_estimate(diffs, weights, m)
        assert info["rtol"] == rtol and info["max_samples_per_batch"] == samples
        assert info["met_rtol"] == (info["stderr"] <= rtol * abs(value))
        assert info["rel_stderr"] == pytest.approx(info["stderr"] / abs(value))
        assert info["samples"] == m * len(logits.batches)
    # the loose tolerance stops early, the tight one draws everything and says it was not met
    assert adaptive_average_case(ctx, rho=rho, samples=samples, batch_size=size, rtol=0.3,
                                 min_samples=3)[1]["samples_per_batch"] < samples
    tight = adaptive_average_case(ctx, rho=rho, samples=samples, batch_size=size, rtol=1e-6)[1]
    assert tight["samples_per_batch"] == samples and not tight["met_rtol"]


@pytest.mark.parametrize("name", ["pacbayes_flatness", "pacbayes_mag_flatness"])
def test_the_pacbayes_search_stops_each_sigma_at_its_relative_standard_error(mlp, name):
    """rtol > 0: at each σ the drop's draws stop at the first k ≥ min_samples whose standard error is at
    most rtol × |mean drop| (all `samples` otherwise); each evaluation's drop and standard error are those of
    its first k draws (recomputed here from the same draws); info counts the draws; rtol = 0 is the
    fixed-size search (the entry of the measure without the setting)."""
    spec = all_measures()[name]
    default = _entry(_context(mlp), name)
    assert _entry(_context(mlp), name, rtol=0.0) == {**default, "settings": {**default["settings"], "rtol": 0.0}}
    assert "rtol" not in default["info"]
    rtol, min_samples, samples = 0.05, 3, spec.defaults["samples"]
    record = _entry(_context(mlp), name, rtol=rtol, min_samples=min_samples)
    assert record["status"] == "ok", record
    info = record["info"]
    assert info["rtol"] == rtol and info["draws"] == sum(e["samples"] for e in info["evaluations"])
    assert info["draws"] < info["draws_fixed"] == samples * len(info["evaluations"])
    ctx = _context(mlp).for_measure(name, spec.settings(None))
    params = {k: p.detach() for k, p in ctx.model.named_parameters()}
    base = accuracy(ctx)
    eps = spec.defaults.get("eps")
    for ev in info["evaluations"]:
        drops = []
        for m in range(samples):
            z = standard_normals(params, ctx.generator(f"sample{m}"))
            noise = scale_perturbation(params, ev["sigma"], z, eps)
            drops.append(base - accuracy(ctx, {k: params[k] + noise[k] for k in params}))
        d = torch.tensor(drops, dtype=torch.float64)

        def se(k: int) -> float:
            return float(d[:k].std(unbiased=True)) / math.sqrt(k)

        stop = next((k for k in range(min_samples, samples) if se(k) <= rtol * abs(float(d[:k].mean()))), samples)
        assert ev["samples"] == stop
        assert ev["drop"] == float(d[:stop].mean()) and ev["stderr"] == se(stop)


def test_results_stored_before_the_rtol_setting_stay_up_to_date(tmp_path):
    """The settings rtol and min_samples were added after results were committed; their defaults compute what
    the measures computed without them, so a stored entry without them is up to date under the default
    settings (not recomputed), and stale once rtol is set: checked on a committed study's entries too, as
    stored (up to date) and with the two settings taken out (up to date where the study leaves them at their
    defaults, stale where it sets them: the committed configs set rtol 0.05 for the PAC-Bayes searches)."""
    names = list(MC)
    cfg = MeasureConfig(measures=tuple(names))
    results = {}
    for name in names:
        spec = get_measure(name)
        old = {k: v for k, v in spec.settings().items() if k not in ("rtol", "min_samples")}
        results[name] = {"status": "ok", "values": {name: 1.0}, "settings": old,
                         "context": measurement_context(cfg, spec)}
        assert spec.added_settings == {"rtol", "min_samples"} and spec.defaults["rtol"] == 0.0
    _, todo = pending_entries(tmp_path, names, cfg, results=results)
    assert todo == []
    tight = dataclasses.replace(cfg, settings={"pacbayes_flatness": {"rtol": 0.05}})
    _, todo = pending_entries(tmp_path, names, tight, results=results)
    assert [key for _, _, key in todo] == ["pacbayes_flatness"]
    committed = Path(__file__).resolve().parents[2] / "results" / "cpu" / "yi_mnist"
    run = min((committed / "runs").iterdir())
    stored = json.loads((run / "measures.json").read_text())
    study_cfg = read_saved_study(committed).measure
    tightened = set()
    for name in names:
        spec = get_measure(name)
        record = stored[name]
        older = {**record, "settings": {k: v for k, v in record["settings"].items() if k not in spec.added_settings}}
        settings, context = spec.settings(study_cfg.settings), measurement_context(study_cfg, spec)
        at_defaults = all(settings[k] == spec.defaults[k] for k in spec.added_settings)
        tightened |= set() if at_defaults else {name}
        assert up_to_date(record, spec, settings, context, record.get("model_sha256"))  # as stored
        # as a study stored before the settings existed: current only where the study keeps their defaults
        assert up_to_date(older, spec, settings, context, older.get("model_sha256")) == at_defaults, name
    assert tightened == {"pacbayes_flatness", "pacbayes_mag_flatness"}  # configs/cpu/yi_mnist.yaml's rtol
