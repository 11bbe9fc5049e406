"""`flatbench audit` on a tiny trained experiment: per-run audit and the population stress test."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from flatbench.cli import audit
from flatbench.config import parse_study
from flatbench.errors import FlatbenchError
from flatbench.store import run_dir
from flatbench.training import train_run

MEASURES = "normalized_sharpness,matrix_normalized_sharpness,hessian_trace,frobenius_norm"


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny MLPs (label noise 0, 0.5, 1) trained for 2 epochs on mnist_mini."""
    from flatbench.study.spec import save_study

    out = tmp_path_factory.mktemp("audit")
    study = parse_study({"name": "tiny_audit",
                         "data": {"dataset": "mnist_mini", "n_train": 256, "n_test": 128,
                                  "random_label_ratio": [0.0, 0.5, 1.0]},
                         "model": {"widths": [16]}, "train": {"epochs": 2},
                         "measure": {"n_examples": 96}}, out=str(out))
    save_study(study)
    for rid, cfg in study.runs:
        train_run(rid, cfg, run_dir(study.exp_dir, rid), torch.device("cpu"), progress=False,
                  echo=lambda _m: None)
    return study.exp_dir


def _invoke(*args: str):
    result = CliRunner().invoke(audit, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_run_audit_writes_table_and_heatmap(experiment: Path) -> None:
    run = min((experiment / "runs").iterdir())
    result = _invoke(str(run), "--trials", "2", "--measures", MEASURES, "--device", "cpu")
    frame = pd.read_csv(run / "audit.csv")
    assert list(frame.columns)[:6] == ["measure", "family", "trial", "value", "baseline", "rel_change"]
    assert {"declared_invariant", "status", "function_change"} <= set(frame.columns)
    # mlp without BatchNorm: bn does not apply, the other three families run twice each
    assert set(frame["family"]) == {"layer", "node", "logit_scale"}
    assert set(frame["measure"]) == set(MEASURES.split(","))
    assert len(frame) == 4 * 3 * 2 and set(frame["trial"]) == {0, 1}
    assert (frame["status"] == "ok").all() and (frame["function_change"] < 1e-8).all()
    ns = frame[(frame["measure"] == "normalized_sharpness") & frame["family"].isin(["layer", "node"])]
    assert (ns["rel_change"] < 1e-6).all() and ns["declared_invariant"].all()
    hess = frame[(frame["measure"] == "hessian_trace") & (frame["family"] == "node")]
    assert (hess["rel_change"] > 0.1).all() and not hess["declared_invariant"].any()
    png = (run / "audit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 2000
    assert "normalized_sharpness" in result.output and "declared invariant" in result.output
    assert "bn: not applicable" in result.output
    assert "not met" not in result.output


def test_population_audit_compares_correlations(experiment: Path, tmp_path: Path) -> None:
    """The real CLI with its defaults: 3 draws for each of the ranges F = 2 and F = 100."""
    result = _invoke(str(experiment), "--population", "--family", "node", "--measures",
                     "normalized_sharpness,frobenius_norm", "--out", str(tmp_path), "--device", "cpu")
    corr = pd.read_csv(tmp_path / "audit_correlations.csv")
    assert list(corr.columns) == ["measure", "family", "max_factor", "n_draws", "n_draws_ok", "n", "tau_original",
                                  "p_original", "tau_mean", "delta_mean", "delta_min", "delta_max", "delta_absmax",
                                  "p_transformed_max", "tau_draw_0", "tau_draw_1", "tau_draw_2",
                                  "median_rel_change", "declared_invariant", "status", "note"]
    assert list(corr["measure"]) == ["normalized_sharpness"] * 2 + ["frobenius_norm"] * 2
    assert list(corr["max_factor"]) == [2.0, 100.0, 2.0, 100.0]
    assert (corr["n"] == 3).all() and (corr["n_draws"] == 3).all() and (corr["status"] == "ok").all()
    ns = corr[corr["measure"] == "normalized_sharpness"]
    for column in ("tau_draw_0", "tau_draw_1", "tau_draw_2", "tau_mean"):
        assert ns[column].to_numpy() == pytest.approx(ns["tau_original"].to_numpy())
    assert (ns["delta_absmax"].abs() < 1e-12).all() and (ns["median_rel_change"] < 1e-6).all()
    assert ns["declared_invariant"].all()
    per_run = pd.read_csv(tmp_path / "audit_population.csv")
    assert len(per_run) == 3 * 2 * 2 * 3 and set(per_run["status"]) == {"ok"}
    assert set(per_run["max_factor"]) == {2.0, 100.0} and set(per_run["draw"]) == {0, 1, 2}
    draws = pd.read_csv(tmp_path / "audit_draws.csv")
    assert len(draws) == 2 * 2 * 3 and {"tau_transformed", "delta", "p_transformed"} <= set(draws.columns)
    assert (tmp_path / "audit_correlations.png").read_bytes().startswith(b"\x89PNG")
    assert "Kendall" in result.output and "F=2" in result.output and "F=100" in result.output


def test_population_audit_cli_ranges_and_draws(experiment: Path, tmp_path: Path) -> None:
    """`--max-factors 2,100` is the same as `--max-factor 2 --max-factor 100`; one range and --draws work."""
    _invoke(str(experiment), "--population", "--measures", "frobenius_norm", "--max-factors", "2,100",
            "--draws", "2", "--out", str(tmp_path / "a"), "--device", "cpu", "--fresh")
    _invoke(str(experiment), "--population", "--measures", "frobenius_norm", "--max-factor", "2",
            "--max-factor", "100", "--draws", "2", "--out", str(tmp_path / "b"), "--device", "cpu")
    a = pd.read_csv(tmp_path / "a" / "audit_population.csv")
    b = pd.read_csv(tmp_path / "b" / "audit_population.csv")
    pd.testing.assert_frame_equal(a.drop(columns="seconds"), b.drop(columns="seconds"))
    _invoke(str(experiment), "--population", "--measures", "frobenius_norm", "--max-factor", "10",
            "--draws", "1", "--out", str(tmp_path / "c"), "--device", "cpu")
    c = pd.read_csv(tmp_path / "c" / "audit_correlations.csv")
    assert list(c["max_factor"]) == [10.0] and "tau_draw_0" in c and "tau_draw_1" not in c


def test_population_audit_declared_only_keeps_the_measures_declaring_the_family(experiment: Path,
                                                                               tmp_path: Path) -> None:
    """`--declared`: a layer-wise audit of the measures that claim layer-wise invariance (matrix-normalized and
    normalized sharpness here), the others (the trace, the Frobenius norm) left out; none left is one error."""
    _invoke(str(experiment), "--population", "--family", "layer", "--declared", "--measures", MEASURES,
            "--max-factor", "10", "--draws", "1", "--out", str(tmp_path / "d"), "--device", "cpu")
    rows = pd.read_csv(tmp_path / "d" / "audit_population.csv")
    assert sorted(set(rows["measure"])) == ["matrix_normalized_sharpness", "normalized_sharpness"]
    corr = pd.read_csv(tmp_path / "d" / "audit_correlations.csv")
    assert corr["declared_invariant"].all()
    result = CliRunner().invoke(audit, [str(experiment), "--population", "--family", "node", "--declared",
                                        "--measures", "hessian_trace,frobenius_norm", "--out", str(tmp_path / "e"),
                                        "--device", "cpu"])
    assert "none of the study's measures declares invariance to the node" in str(result.exception)
    result = CliRunner().invoke(audit, [str(next((experiment / "runs").iterdir())), "--declared"])
    assert "--declared is for the population audit" in str(result.exception)


def _population(experiment: Path, out: Path, measures: str, **kw):
    from flatbench.study.population import audit_population

    return audit_population(experiment, family="node", measures=measures.split(","), device="cpu", out_dir=out,
                            echo=lambda _m: None, **kw)


def test_population_draws_are_seeded_distinct_and_in_range(experiment: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every (range, draw) copy has its own factors, inside its range, and the same ones on a second call;
    a copy's value is the one it gets when measured alone; an undeclared measure moves under harsh draws
    and a declared-invariant one never moves."""
    import flatbench.rescale as rescale
    from flatbench.measures.runner import load_context, plan_context
    from flatbench.study import audit as audit_mod
    from flatbench.study import population as population_mod

    drawn: list[tuple[float, float, torch.Tensor]] = []
    real = rescale.log_uniform

    def recording(n, generator, low=0.1, high=10.0):
        out = real(n, generator, low, high)
        drawn.append((low, high, out.clone()))
        return out

    monkeypatch.setattr(rescale, "log_uniform", recording)
    measures = "frobenius_norm,path_norm,normalized_sharpness"
    corr = _population(experiment, tmp_path / "one", measures)
    first = list(drawn)
    assert len(first) == 3 * 2 * 3  # runs x ranges x draws; the MLP has one hidden layer: one call per copy
    for low, high, factors in first:
        assert high in (2.0, 100.0) and low == pytest.approx(1 / high)
        assert (factors >= low).all() and (factors <= high).all()
    harsh = torch.cat([f for _, h, f in first if h == 100.0])
    assert float(harsh.max()) > 2 and float(harsh.min()) < 0.5  # the harsh range is used, not the mild one
    assert len({tuple(f.tolist()) for _, _, f in first}) == len(first)  # every copy its own factors
    drawn.clear()
    _population(experiment, tmp_path / "two", measures)
    assert [(lo, hi, f.tolist()) for lo, hi, f in drawn] == [(lo, hi, f.tolist()) for lo, hi, f in first]
    one = pd.read_csv(tmp_path / "one" / "audit_population.csv")
    two = pd.read_csv(tmp_path / "two" / "audit_population.csv")
    pd.testing.assert_frame_equal(one.drop(columns="seconds"), two.drop(columns="seconds"))
    fro = one[one["measure"] == "frobenius_norm"]
    for (_run, _factor), group in fro.groupby(["run_id", "max_factor"]):
        assert group["transformed"].nunique() == 3  # the draws differ
    # one copy measured alone (fresh context, its own generator) gives the same value, bit for bit
    run = min((experiment / "runs").iterdir())
    copy = population_mod.population_rescaling(run.name, "node", 100.0, 1)  # a rescaled target, loaded on its own
    sub = load_context(plan_context(run, audit_mod.measure_config(experiment)).rescaled(copy), torch.device("cpu"))
    entry = next(e for e in audit_mod.plan_entries(["frobenius_norm"], audit_mod.measure_config(experiment)))
    alone = audit_mod.measure_entry(sub, entry)["values"]["frobenius_norm"]
    row = fro[(fro["run_id"] == run.name) & (fro["max_factor"] == 100.0) & (fro["draw"] == 1)]
    assert float(row["transformed"].iloc[0]) == alone
    # Δτ: declared invariants keep τ on every draw of both ranges; frobenius_norm is moved by harsh draws
    for name in ("path_norm", "normalized_sharpness"):
        part = corr[corr["measure"] == name]
        assert set(part["max_factor"]) == {2.0, 100.0} and part["declared_invariant"].all()
        assert (part["status"] == "ok").all()
        for d in range(3):
            assert part[f"tau_draw_{d}"].to_numpy() == pytest.approx(part["tau_original"].to_numpy(), abs=1e-12)
    rel = one[one["measure"].isin(["path_norm", "normalized_sharpness"])]["rel_change"]
    assert (rel < 1e-8).all()
    harsh_fro = fro[fro["max_factor"] == 100.0]
    assert (harsh_fro["rel_change"] > 0.1).all()
    assert not corr[corr["measure"] == "frobenius_norm"]["declared_invariant"].any()


def test_population_copies_read_their_runs_draws_and_get_their_lone_values(experiment: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28 (a): the Monte-Carlo measures' random draws depend on the run's seed and the parameters' shapes
    only, so the copies of a run read the draws its first computation made (`ctx.draws`) instead of drawing
    them again: every transformed value (and status) is bitwise the one of the copy measured alone, in a fresh
    context of its own, and the PAC-Bayes noise is drawn once per run, not once per copy."""
    from flatbench.measures.builtin import pacbayes
    from flatbench.measures.runner import load_context, plan_context
    from flatbench.study import audit as audit_mod
    from flatbench.study import population as population_mod

    calls = []
    real = pacbayes.standard_normals

    def counting(params, generator):
        calls.append(1)
        return real(params, generator)

    monkeypatch.setattr(pacbayes, "standard_normals", counting)
    names = ["adaptive_sharpness_avg", "pacbayes_flatness"]
    _population(experiment, tmp_path, ",".join(names), draws=2)
    rows = pd.read_csv(tmp_path / "audit_population.csv")
    cfg = audit_mod.measure_config(experiment)
    samples = cfg.settings.get("pacbayes_flatness", {}).get("samples", 10)
    searched = rows[(rows["measure"] == "pacbayes_flatness") & (rows["original_source"] == "computed")]
    assert len(calls) == samples * searched["run_id"].nunique()  # once per run (its original), never per copy
    ok = rows[rows["status"] == "ok"]
    assert set(rows["status"]) <= {"ok", "no_original"} and set(ok["measure"]) == set(names)
    monkeypatch.setattr(pacbayes, "standard_normals", real)
    entries = audit_mod.plan_entries(names, cfg)
    for run in sorted((experiment / "runs").iterdir()):
        for factor in (2.0, 100.0):
            for draw in range(2):
                copy = population_mod.population_rescaling(run.name, "node", factor, draw)
                sub = load_context(plan_context(run, cfg).rescaled(copy), torch.device("cpu"))  # fresh: no draws
                for entry in entries:
                    alone = audit_mod.measure_entry(sub, entry)
                    row = ok[(ok["run_id"] == run.name) & (ok["measure"] == entry.key)
                             & (ok["max_factor"] == factor) & (ok["draw"] == draw)]
                    if len(row):  # (a run whose untransformed value failed has no copies computed)
                        assert alone["status"] == "ok"
                        assert float(row["transformed"].iloc[0]) == alone["values"][entry.key], (run.name, entry.key)


def test_population_recomputes_an_untransformed_value_of_other_settings(experiment: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The untransformed value is read from measures.json only when it was computed with the audit's settings
    (measurement context and model file too): a study whose Monte-Carlo measure got an `rtol` after it was
    measured has its originals computed again, with the copies' settings, never compared across settings."""
    import dataclasses
    import shutil

    from flatbench.measures.runner import build_context, measure_run
    from flatbench.study import audit as audit_mod
    from flatbench.study import population as population_mod

    exp = tmp_path / "exp"
    shutil.copytree(experiment, exp, ignore=shutil.ignore_patterns("audit*"))
    cfg = audit_mod.measure_config(exp)
    names = ["frobenius_norm", "adaptive_sharpness_avg"]
    for run in (exp / "runs").iterdir():
        measure_run(run, names, cfg, torch.device("cpu"))
    _population(exp, tmp_path / "same", ",".join(names), draws=1)
    same = pd.read_csv(tmp_path / "same" / "audit_population.csv")
    assert set(same["original_source"]) == {"measures.json"}
    other = dataclasses.replace(cfg, settings={"adaptive_sharpness_avg": {"rtol": 0.5, "min_samples": 2}})
    monkeypatch.setattr(population_mod, "measure_config", lambda *_a, **_k: other)
    _population(exp, tmp_path / "other", ",".join(names), draws=1)
    rows = pd.read_csv(tmp_path / "other" / "audit_population.csv")
    source = rows.groupby("measure")["original_source"].agg(set).to_dict()
    assert source == {"frobenius_norm": {"measures.json"}, "adaptive_sharpness_avg": {"computed"}}
    ctx_values = []
    for run in sorted((exp / "runs").iterdir()):
        ctx = build_context(run, other, torch.device("cpu"))
        entry = audit_mod.plan_entries(["adaptive_sharpness_avg"], other)[0]
        ctx_values.append(audit_mod.measure_entry(ctx, entry)["values"]["adaptive_sharpness_avg"])
    originals = rows[rows["measure"] == "adaptive_sharpness_avg"].drop_duplicates("run_id").sort_values("run_id")
    assert list(originals["original"]) == ctx_values


def test_population_missing_transformed_value_is_not_zero(experiment: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A measure that fails on every transformed copy: status no_transformed, τ and Δτ empty (not 0), n/a in
    the printed table; a measure that fails on one copy only is `partial`."""
    from flatbench.study import population as population_mod

    copies: set[int] = set()
    real_load, real_compute = population_mod.load_context, population_mod.measure_entry

    def load(plan, device, base=None):
        ctx = real_load(plan, device, base)
        if plan.target.rescaling is not None:
            copies.add(id(ctx.model))
        return ctx

    def compute(ctx, entry):
        if id(ctx.model) in copies and entry.key == "path_norm":
            return {"status": "error", "error": "RuntimeError: boom", "seconds": 0.0}
        return real_compute(ctx, entry)

    monkeypatch.setattr(population_mod, "load_context", load)
    monkeypatch.setattr(population_mod, "measure_entry", compute)
    lines: list[str] = []
    corr = population_mod.audit_population(experiment, family="node", measures=["path_norm", "frobenius_norm"],
                                      device="cpu", out_dir=tmp_path, echo=lines.append, draws=2)
    pn = corr[corr["measure"] == "path_norm"]
    assert list(pn["status"]) == ["no_transformed", "no_transformed"]
    assert pn["tau_original"].notna().all() and (pn["n_draws_ok"] == 0).all()
    for column in ("delta_mean", "delta_min", "delta_max", "delta_absmax", "tau_mean", "tau_draw_0", "tau_draw_1"):
        assert pn[column].isna().all(), column
    assert pn["note"].str.contains("error on 6 of 6 copies").all()
    saved = pd.read_csv(tmp_path / "audit_correlations.csv")
    assert saved[saved["measure"] == "path_norm"]["delta_mean"].isna().all()
    per_run = pd.read_csv(tmp_path / "audit_population.csv")
    assert set(per_run[per_run["measure"] == "path_norm"]["status"]) == {"error"}
    table = "\n".join(lines)
    row = next(line for line in table.splitlines() if line.startswith("path_norm"))
    assert "n/a (no_transformed)" in row and "+0.000" not in row.split()[3:]
    assert (tmp_path / "audit_correlations.png").read_bytes().startswith(b"\x89PNG")


def test_population_audit_resumes_finished_runs(experiment: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A second call with the same settings reuses every finished run; other settings recompute."""
    from flatbench.study import population as population_mod

    first = _population(experiment, tmp_path, "frobenius_norm", draws=1)
    calls: list[str] = []
    real = population_mod._audit_one_run

    def counting(context, *args, **kw):
        calls.append(context.target.run_path.name)
        return real(context, *args, **kw)

    monkeypatch.setattr(population_mod, "_audit_one_run", counting)
    again = _population(experiment, tmp_path, "frobenius_norm", draws=1)
    assert calls == []
    pd.testing.assert_frame_equal(first, again)
    _population(experiment, tmp_path, "frobenius_norm", draws=2)  # a draw more: every run again
    assert len(calls) == 3
    _population(experiment, tmp_path, "frobenius_norm", draws=2, fresh=True)
    assert len(calls) == 6


def test_population_audit_in_worker_processes_gives_the_rows_of_a_lone_audit(experiment: Path,
                                                                             tmp_path: Path) -> None:
    """--workers 2: the runs are audited in two processes; every row (but its seconds) and the written
    correlations are those of the audit in one process, in the runs' order."""
    alone = _population(experiment, tmp_path / "alone", "frobenius_norm,path_norm", draws=1)
    pooled = _population(experiment, tmp_path / "pooled", "frobenius_norm,path_norm", draws=1, workers=2)
    pd.testing.assert_frame_equal(alone, pooled)
    a = pd.read_csv(tmp_path / "alone" / "audit_population.csv").drop(columns="seconds")
    b = pd.read_csv(tmp_path / "pooled" / "audit_population.csv").drop(columns="seconds")
    pd.testing.assert_frame_equal(a, b)
    with pytest.raises(FlatbenchError, match="--workers must be at least 1"):
        _population(experiment, tmp_path / "none", "frobenius_norm", draws=1, workers=0)


def test_old_audit_files_are_read() -> None:
    """A committed audit_correlations.csv of the single-draw audit is read as one draw, labelled so."""
    from flatbench.analysis.audit_plots import audit_correlations_figure
    from flatbench.analysis.audit_tables import OLD_FORMAT, format_correlations, normalize_correlations

    old = pd.DataFrame([{"measure": "path_norm", "family": "node", "n": 22, "tau_original": 0.5,
                         "tau_transformed": 0.5, "delta": 0.0, "p_original": 0.01, "p_transformed": 0.01,
                         "median_rel_change": 1e-15, "declared_invariant": True},
                        {"measure": "minimum_sharpness", "family": "node", "n": 0, "tau_original": float("nan"),
                         "tau_transformed": float("nan"), "delta": float("nan"), "p_original": float("nan"),
                         "p_transformed": float("nan"), "median_rel_change": float("nan"),
                         "declared_invariant": False}])
    frame = normalize_correlations(old)
    assert list(frame["status"]) == ["ok", "no_original"] and (frame["audit_format"] == OLD_FORMAT).all()
    assert list(frame["n_draws"]) == [1, 1]
    text = format_correlations(old, "acc", "node")
    assert OLD_FORMAT in text and "n/a" in text.splitlines()[-2]
    assert audit_correlations_figure(old, "acc", "node").startswith(b"\x89PNG")


def test_audit_rejects_bad_targets(experiment: Path) -> None:
    from flatbench.errors import FlatbenchError

    with pytest.raises(FlatbenchError, match="--population"):
        CliRunner().invoke(audit, [str(experiment)], catch_exceptions=False)
    run = min((experiment / "runs").iterdir())
    with pytest.raises(FlatbenchError, match="unknown family"):
        CliRunner().invoke(audit, [str(run), "--families", "layer,rotate"], catch_exceptions=False)
    with pytest.raises(FlatbenchError, match="one --max-factor"):
        CliRunner().invoke(audit, [str(run), "--max-factors", "2,100"], catch_exceptions=False)
    with pytest.raises(FlatbenchError, match="larger than 1"):
        CliRunner().invoke(audit, [str(experiment), "--population", "--max-factor", "2,1"], catch_exceptions=False)
    with pytest.raises(FlatbenchError, match="--draws"):
        CliRunner().invoke(audit, [str(experiment), "--population", "--draws", "0"], catch_exceptions=False)


def test_population_csv_is_rewritten_as_runs_finish_but_spaced_when_it_is_large(experiment: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """audit_population.csv is rewritten after a finished run once SAVE_COST_RATIO times the last rewrite's cost
    has passed since it (a study of many runs was quadratic when every run rewrote it): with a ratio of 0
    after every run, with a huge one only after the first run and at the end; the file is the same."""
    from flatbench.study import population as population_mod

    writes: list[int] = []
    real = population_mod.atomic_write_text

    def counting(path, text):
        if Path(path).name == population_mod.POPULATION_CSV:
            writes.append(text.count("\n"))
        return real(path, text)

    monkeypatch.setattr(population_mod, "atomic_write_text", counting)
    monkeypatch.setattr(population_mod, "SAVE_COST_RATIO", 0.0)  # every rewrite free: after every run
    first = _population(experiment, tmp_path / "each", "frobenius_norm", draws=1)
    runs = len(list((experiment / "runs").iterdir()))
    assert len(writes) == runs + 1 and writes == sorted(writes)  # after every run, then the final one
    writes.clear()
    monkeypatch.setattr(population_mod, "SAVE_COST_RATIO", 1e9)
    spaced = _population(experiment, tmp_path / "spaced", "frobenius_norm", draws=1)
    assert len(writes) == 2  # after the first run only (nothing had been written), then the final one
    pd.testing.assert_frame_equal(first, spaced)
    a = pd.read_csv(tmp_path / "each" / "audit_population.csv").drop(columns="seconds")
    b = pd.read_csv(tmp_path / "spaced" / "audit_population.csv").drop(columns="seconds")
    pd.testing.assert_frame_equal(a, b)


def test_the_population_audit_keeps_a_stored_value_by_the_measure_stages_rule(tmp_path: Path) -> None:
    """Issue 43, one rule for whether a stored entry is current (`measures.runner.up_to_date`, the measure
    stage's): the population audit reads an untransformed value from measures.json only where the measure stage
    would keep it, so not one computed with an earlier version of a loss file of one's own; and an edited loss
    file changes the audit's row signature too (a built-in loss adds nothing: committed signatures stay)."""
    import dataclasses

    from flatbench.config import MeasureConfig
    from flatbench.losses import loss_source
    from flatbench.study import audit as audit_mod
    from flatbench.study import population as population_mod

    loss = tmp_path / "loss_a.py"
    text = "import torch.nn.functional as F\nSCALE = {}\n\ndef scaled(logits, targets):\n" \
           "    return SCALE * F.cross_entropy(logits, targets, reduction='none')\n"
    loss.write_text(text.format(1.0))
    cfg = MeasureConfig(measures=("hessian_trace",), losses=("ce", f"{loss}:scaled"))
    entry = next(e for e in audit_mod.plan_entries(None, cfg) if e.loss not in (None, "ce"))
    record = {"status": "ok", "values": {entry.key: 1.0}, "settings": entry.settings, "context": entry.context,
              "model_sha256": "abc", "loss_source": loss_source(entry.loss)}

    def signature(config):
        return population_mod._signature(population_mod._settings_signature(config), "node", "abc")

    before = signature(cfg)
    assert "loss_sha256" not in population_mod._settings_signature(dataclasses.replace(cfg, losses=("ce",)))
    assert population_mod._stored_original({entry.key: record}, entry, {"model_sha256": "abc"}) is record
    loss.write_text(text.format(20.0))  # (another size: a new hash whatever the clock's resolution)
    assert population_mod._stored_original({entry.key: record}, entry, {"model_sha256": "abc"}) is None
    assert signature(cfg) != before
