"""The report stage end to end on synthetic experiment folders (run.json + measures.json written here)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flatbench.analysis.report import plot_filename, write_report
from flatbench.analysis.table import build_table
from flatbench.config import ReportConfig, run_config_from_dict
from flatbench.errors import FlatbenchError

RATIOS = (0.0, 0.25, 0.5, 0.75)
SEEDS = (0, 1)


def write_experiment(root: Path, name: str, *, dataset: str = "mnist_mini", model: str = "mlp",
                     seed: int = 0, study_yaml: bool = True, real_ids: bool = False) -> Path:
    """An experiment folder in the layout training and measuring write: 4 ratios × 2 seeds.

    `tracks` grows with the gap over two decades (log axis), `noise` is random, `flat` is a measure
    registered (in the tests) with larger_is_sharper=False and decreases with the gap; there is also a
    per-layer detail, a loss-suffixed key, a not-applicable and a failed measure. `real_ids`: the folders named
    by their configs' run ids, as `flatbench report` (which refuses a run.json describing another run) needs.
    """
    rng = np.random.default_rng(seed)
    exp = root / name
    for ratio in RATIOS:
        for s in SEEDS:
            config = {"seed": s, "data": {"dataset": dataset, "random_label_ratio": ratio, "n_train": None},
                      "model": {"name": model, "widths": [512, 512]}, "train": {"lr": 0.001}}
            run_id = run_config_from_dict(config).run_id() if real_ids else f"{model}-{dataset}-r{ratio:.2f}-s{s}"
            run_dir = exp / "runs" / run_id
            run_dir.mkdir(parents=True)
            test_acc = 0.97 - 0.8 * ratio + rng.normal(0, 0.02)
            gap = 0.99 - test_acc
            info = {
                "run_id": run_id, "status": "finished",
                "config": config,
                "sweep_axes": ["data.random_label_ratio", "seed"],
                "dataset": {"name": dataset, "num_classes": 10, "n_train": 6000, "n_test": 1000},
                "labels": {"scheme": "uniform", "ratio": ratio, "n_corrupted": int(6000 * ratio),
                           "n_changed": int(5400 * ratio)},
                "train_acc": 0.99, "train_loss": 0.03, "test_acc": test_acc, "test_loss": 0.4 + 3 * ratio,
                "gap_acc": gap, "gap_loss": 0.37 + 3 * ratio, "epochs": 20, "seconds": 10.0, "device": "cpu",
                "history": [{"epoch": 1, "train_loss": 0.5, "train_acc": 0.8, "seconds": 0.5}],
            }
            measures = {
                "tracks": {"status": "ok", "values": {"tracks": float(10 ** (1 + 3 * gap)),
                                                      "tracks/layers.0.weight": 1.0 + gap},
                           "seconds": 0.25, "settings": {}, "info": {}},
                "tracks@normalized_ce": {"status": "ok", "values": {"tracks@normalized_ce": 2.0 + gap},
                                         "seconds": 0.5},
                "noise": {"status": "ok", "values": {"noise": float(rng.normal())}, "seconds": 0.1},
                "flat": {"status": "ok", "values": {"flat": 5.0 - gap}, "seconds": 0.1,
                         "larger_is_sharper": False},
                "psi_flatness": {"status": "not_applicable", "reason": "needs a bias-free ReLU net",
                                 "seconds": 0.0},
                "eps_sharpness": {"status": "error", "error": "optimizer diverged", "seconds": 0.5},
            }
            (run_dir / "run.json").write_text(json.dumps(info))
            (run_dir / "measures.json").write_text(json.dumps(measures))
    if study_yaml:
        (exp / "study.yaml").write_text(f"name: {name}\ndata:\n  dataset: {dataset}\n"
                                        "  random_label_ratio: [0.0, 0.25, 0.5, 0.75]\nseed: [0, 1]\n")
    return exp


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One report over the synthetic study, shared by the tests that only read its outputs."""
    exp = write_experiment(tmp_path_factory.mktemp("exp"), "synth")
    lines: list[str] = []
    summary = write_report([exp], exp, n_boot=200, echo=lines.append)
    return exp, summary, "\n".join(lines)


def test_report_seed_is_an_option(tmp_path):
    """`flatbench report --seed S`: the seed is recorded and changes only the resampling."""
    from click.testing import CliRunner

    from flatbench.cli import cli

    exp = write_experiment(tmp_path, "seeded", study_yaml=False, real_ids=True)
    result = CliRunner().invoke(cli, ["report", str(exp), "--seed", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    md = (exp / "report.md").read_text()
    assert "seed = 3" in md and "report seed 3" in md
    assert "no measure can be compared with the best" in md  # 8 runs: below 10, no best group


def test_report_files(report):
    exp, summary, _ = report
    for name in ("table.csv", "correlations.csv", "report.md", "report.html"):
        assert (exp / name).is_file(), name
    plots = exp / "plots"
    for name in ("ranking.png", "vs_ratio.png", "agreement.png", "sign_errors.png", "training_curves.png",
                 "scatter_other.png"):
        assert (plots / name).is_file(), name
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(plots.glob("*layers*"))  # per-layer details are not plotted
    assert not (plots / "comparisons.png").exists()  # 8 runs: no paired interval, so no comparison matrix
    assert sorted(summary.plots) == sorted(plots.glob("*.png"))


def test_table_columns(report):
    exp, summary, _ = report
    table = pd.read_csv(exp / "table.csv")
    for col in ("run_id", "experiment", "status", "seed", "data.random_label_ratio", "data.dataset",
                "model.name", "model.widths", "train.lr", "train_acc", "test_acc", "train_loss", "test_loss",
                "gap_acc", "gap_loss", "epochs", "train_seconds", "tracks", "tracks/layers.0.weight",
                "tracks@normalized_ce", "noise", "flat", "psi_flatness", "eps_sharpness"):
        assert col in table.columns, col
    assert len(table) == len(RATIOS) * len(SEEDS)
    assert set(table["model.widths"]) == {"512x512"}
    assert set(table["experiment"]) == {"synth"}
    assert table["eps_sharpness"].isna().all()
    assert summary.table.attrs["sweep_axes"] == ["data.random_label_ratio", "seed"]


def test_correlations_csv(report):
    exp, summary, _ = report
    corr = pd.read_csv(exp / "correlations.csv")
    for col in ("measure", "n", "kendall_tau", "kendall_tau_lo", "kendall_tau_hi", "spearman_rho",
                "spearman_rho_lo", "spearman_rho_hi", "pearson_r", "pearson_r_lo", "pearson_r_hi", "psi",
                "psi_data.random_label_ratio", "cmi", "cmi_condition", "cmi_min_pairs", "larger_is_sharper",
                "kendall_p_method", "vs_best", "vs_best_p", "vs_best_p_holm", "vs_best_mcse", "vs_best_borderline",
                "sign_error_mean", "sign_error_worst", "n_environments", "seed_pairs_concordant", "n_seed_pairs"):
        assert col in corr.columns, col
    assert "psi_seed" not in corr.columns  # the seed is a replicate, never a hyperparameter axis
    # 8 runs: below 10, no measure can be compared with the best one
    assert set(corr["vs_best"].dropna()) <= {"best", "cannot compare"}
    assert (corr.set_index("measure").loc["noise", "n_seed_pairs"]) == 4
    assert not any("/" in m for m in corr["measure"])  # per-layer keys stay out of the statistics
    by = corr.set_index("measure")
    assert by.loc["tracks", "kendall_tau"] == pytest.approx(1.0)
    assert by.loc["flat", "kendall_tau"] == pytest.approx(1.0)  # negated: smaller = sharper
    assert not by.loc["flat", "larger_is_sharper"]
    assert abs(by.loc["noise", "kendall_tau"]) < 0.9
    assert by.loc["eps_sharpness", "n"] == 0 and by.loc["tracks", "n"] == 8
    assert summary.best_measure in {"tracks", "tracks@normalized_ce", "flat"}


def test_html_is_self_contained(report):
    exp, summary, _ = report
    html = (exp / "report.html").read_text()
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html, flags=re.IGNORECASE)
    assert refs, "expected embedded images"
    assert all(not r.lower().startswith(("http:", "https:", "//")) for r in refs)
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html.lower()
    # inline script and data only: no script is loaded from anywhere
    scripts = re.findall(r"<script[^>]*>", html, flags=re.IGNORECASE)
    assert scripts and all("src" not in tag.lower() for tag in scripts)
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == len(summary.plots)
    for section in ("More statistics", "Excluded runs", "Study config", "Measures and time", "training",
                    "measuring", "random_label_ratio: [0.0, 0.25, 0.5, 0.75]", "optimizer diverged"):
        assert section in html, section


def test_markdown_report(report):
    exp, _, _ = report
    md = (exp / "report.md").read_text()
    assert "](plots/scatter_other.png)" in md and "](plots/ranking.png)" in md
    assert "8 runs found, 8 trained" in md
    assert "| 1 | `" in md  # the ranking table
    # readable as text: no raw HTML, and alt texts without backticks
    assert "<" not in md.replace("\\<", "")
    for alt in re.findall(r"!\[([^\]]*)\]", md):
        assert "`" not in alt.replace("\\`", ""), alt


def test_terminal_summary_best_first(report):
    _, summary, text = report
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "tau [95% CI]" in line)
    body = [line for line in lines[header + 1:] if re.match(r"\s+\d+\s", line)]
    rows = [line.split()[1] for line in body]
    assert rows[0] == summary.best_measure
    assert rows.index("noise") > rows.index("tracks")
    assert set(rows[-2:]) == {"eps_sharpness", "psi_flatness"}  # no correlation: last
    # Aligned: every row's τ cell starts where the header's does.
    col = lines[header].index("tau [95% CI]")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in body)


def test_combine_two_experiments(tmp_path):
    a = write_experiment(tmp_path, "mnist_study", seed=1)
    b = write_experiment(tmp_path, "cifar_study", dataset="cifar10", model="lenet", seed=2, study_yaml=False)
    out = tmp_path / "combined"
    lines: list[str] = []
    summary = write_report([a, b], out, n_boot=50, echo=lines.append)
    table = pd.read_csv(out / "table.csv")
    assert set(table["experiment"]) == {"mnist_study", "cifar_study"}
    assert len(table) == 2 * len(RATIOS) * len(SEEDS)
    assert "experiment" in summary.table.attrs["sweep_axes"]
    corr = pd.read_csv(out / "correlations.csv")
    assert "psi_experiment" in corr.columns
    assert corr.set_index("measure").loc["tracks", "n"] == 16
    md = (out / "report.md").read_text()
    assert "No `study.yaml`" in md and "name: mnist_study" in md


def test_same_study_split_in_two_folders_has_no_experiment_axis(tmp_path):
    a = write_experiment(tmp_path / "a", "study", seed=1)
    b = write_experiment(tmp_path / "b", "study", seed=2)
    table = build_table([a, b])
    assert "experiment" not in table.attrs["sweep_axes"]
    assert table["experiment"].nunique() == 2  # same folder names are told apart by their parents


def test_excluded_runs_are_listed(tmp_path):
    exp = write_experiment(tmp_path, "partial")
    runs = sorted((exp / "runs").iterdir())
    info = json.loads((runs[0] / "run.json").read_text())
    info["status"] = "running"
    (runs[0] / "run.json").write_text(json.dumps(info))
    info = json.loads((runs[1] / "run.json").read_text())
    info["train_acc"] = 0.1
    (runs[1] / "run.json").write_text(json.dumps(info))
    info = json.loads((runs[2] / "run.json").read_text())
    info["test_loss"] = "nan"
    (runs[2] / "run.json").write_text(json.dumps(info))
    lines: list[str] = []
    summary = write_report([exp], exp, ReportConfig(min_train_acc=0.5), n_boot=50, echo=lines.append)
    assert summary.n_runs == 8 and summary.n_included == 5
    reasons = {e["run_id"]: e["reason"] for e in summary.excluded}
    assert "status: running" in reasons[runs[0].name]
    assert "train accuracy 0.100 < 0.500" in reasons[runs[1].name]
    assert "non-finite loss" in reasons[runs[2].name]
    md = (exp / "report.md").read_text()
    for run in runs[:3]:
        assert run.name in md
    assert summary.correlations.set_index("measure").loc["tracks", "n"] == 5


@pytest.mark.parametrize("n_runs", [0, 1, 2])
def test_too_few_runs_write_nothing(tmp_path, n_runs):
    """Fewer than 3 usable runs: a clear error, and no file is written (a good report is never replaced
    by an empty one)."""
    exp = write_experiment(tmp_path, "tiny")
    for run in sorted((exp / "runs").iterdir())[n_runs:]:
        for f in run.iterdir():
            f.unlink()
        run.rmdir()
    with pytest.raises(FlatbenchError, match="a report needs at least 3"):
        write_report([exp], exp, n_boot=50, echo=lambda _: None)
    assert not (exp / "table.csv").exists() and not (exp / "report.html").exists()


def test_quiet_prints_one_line(tmp_path):
    exp = write_experiment(tmp_path, "q")
    lines: list[str] = []
    write_report([exp], exp, quiet=True, n_boot=20, echo=lines.append)
    assert "report.html" in lines[0]
    # beyond the one line, only warnings that the verdict may not hold (here: train loss 0.03 > 0.01)
    assert lines[1:] and all(line.startswith("WARNING: ") for line in lines[1:])
    assert "ended above train loss 0.01" in lines[1]


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FlatbenchError, match="does not exist"):
        write_report([tmp_path / "nope"], tmp_path / "out", echo=lambda _: None)


def test_plot_file_names():
    assert plot_filename("hessian_trace@normalized_ce") == "hessian_trace_at_normalized_ce"
    assert plot_filename("a/b c") == "a__b_c"


def _section(md: str, title: str) -> str:
    """The markdown of one `## title` section."""
    start = md.index(f"## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start:end if end > 0 else len(md)]


def test_verdict_lists_measures_without_values_once(report):
    exp, _, _ = report
    md = (exp / "report.md").read_text()
    verdict = _section(md, "Verdict")
    assert "| 1 | `" in verdict and "`noise`" in verdict
    assert "cannot compare (n \\< 10)" in verdict  # 8 runs: no measure is compared with the best
    # a measure without a value is listed once, with its reason, and drawn nowhere
    assert verdict.count("`psi_flatness`: not applicable on all 8 runs: needs a bias-free ReLU net") == 1
    assert verdict.count("`eps_sharpness`: no value on all 8 runs: optimizer diverged") == 1
    html = (exp / "report.html").read_text()
    panels = [p for block in re.findall(r'id="fbfig\d+-points">(.*?)</script>', html)
              for p in json.loads(block)["panels"]]
    assert "tracks" in panels and "psi_flatness" not in panels and "eps_sharpness" not in panels
    assert "Ties (the same τ)" in verdict  # tracks, tracks@normalized_ce and flat all order the runs perfectly


def test_hover_data_points_at_runs(report):
    """Every scatter point of the page names a run that the statistics used, inside its image."""
    exp, summary, _ = report
    html = (exp / "report.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="fb-data">(.*?)</script>', html).group(1))
    ids = [r["id"] for r in data["runs"]]
    assert sorted(ids) == sorted(summary.table["run_id"])
    fields = dict(data["runs"][0]["fields"])
    assert {"model.name", "data.random_label_ratio", "seed"} <= set(fields) and "model" not in fields
    figures = re.findall(r'<figure class="hover" id="(fbfig\d+)"><div class="hoverbox"><img [^>]*width="(\d+)" '
                         r'height="(\d+)"', html)
    assert figures
    for fig_id, width, height in figures:
        spec = json.loads(re.search(rf'id="{fig_id}-points">(.*?)</script>', html).group(1))
        assert spec["points"]
        for x, y, run, panel, value in spec["points"]:
            assert 0 <= x <= int(width) and 0 <= y <= int(height)
            assert 0 <= run < len(ids) and 0 <= panel < len(spec["panels"]) and value is not None


def test_markdown_is_escaped_text():
    from flatbench.analysis.document import Bullets, Document, Image, Paragraph, Table

    doc = Document("t")
    doc.add(Paragraph("Σ_l 2‖W_l‖_F sqrt(Tr H_{W_l}) for `a_b`, **bold**, [a_b](x_y.csv), p <0.001 | *x*"))
    doc.add(Table(["measure", "description"], [["`m_1`", "E_{δ~N(0, ρ²)} max|v| / min|v|"]]))
    doc.add(Bullets(["$5 and ~x~"]))
    doc.add(Image("plots/a.png", b"\x89PNG", "`key_1` against the gap"))
    md = doc.to_markdown()
    assert "Σ\\_l 2‖W\\_l‖\\_F sqrt(Tr H\\_{W\\_l}) for `a_b`, **bold**, [a\\_b](x_y.csv), p \\<0.001 | \\*x\\*" in md
    assert "| `m_1` | E\\_{δ\\~N(0, ρ²)} max\\|v\\| / min\\|v\\| |" in md
    assert "- \\$5 and \\~x\\~" in md
    assert "![key\\_1 against the gap](plots/a.png)" in md
    html = doc.to_html()
    assert "<strong>bold</strong>" in html and '<a href="x_y.csv">a_b</a>' in html and "<code>a_<wbr>b</code>" in html
    assert 'alt="key_1 against the gap"' in html


def test_per_model_tau_when_models_are_pooled(tmp_path):
    a = write_experiment(tmp_path, "mlps", seed=1)
    b = write_experiment(tmp_path, "lenets", model="lenet", seed=2)
    out = tmp_path / "pooled"
    write_report([a, b], out, n_boot=50, echo=lambda _: None)
    verdict = _section((out / "report.md").read_text(), "Verdict")
    header = next(line for line in verdict.splitlines() if line.startswith("| # |"))
    assert header.count("τ `") == 2 and "`lenet lenets`" in header and "`mlp mlps`" in header
    assert header.count("(n 8)") == 2  # τ within each model, over its 8 runs (the same for every measure)
    row = next(line for line in verdict.splitlines() if line.startswith("| ") and "`tracks`" in line)
    assert row.count("(n ") == 0
    # 16 runs but 8 configurations (2 models × 4 ratios) and 2 draws: fewer than 10 units to resample, so no
    # measure is compared with the best (the old stratified bootstrap compared them over the 16 runs)
    assert "indistinguishable" not in verdict and "worse" not in verdict and "cannot compare" in verdict
    md = (out / "report.md").read_text()
    assert "only 8 independent unit(s) to resample" in md and "the 8 configurations (cluster bootstrap)" in md


def _audit_csv(path: Path) -> None:
    rows = []
    for measure, declared, delta in (("tracks", True, 0.0), ("noise", True, 0.2), ("flat", False, math.nan)):
        for factor in (2.0, 100.0):
            d = [delta] * 3
            rows.append({"measure": measure, "family": "node", "max_factor": factor, "n_draws": 3,
                         "n_draws_ok": 0 if math.isnan(delta) else 3, "n": 8, "tau_original": 0.5,
                         "p_original": 0.01, "tau_mean": 0.5 + delta, "delta_mean": delta, "delta_min": delta,
                         "delta_max": delta, "delta_absmax": abs(delta), "p_transformed_max": 0.02,
                         "tau_draw_0": 0.5 + d[0], "tau_draw_1": 0.5 + d[1], "tau_draw_2": 0.5 + d[2],
                         "median_rel_change": 0.1, "declared_invariant": declared,
                         "status": "no_transformed" if math.isnan(delta) else "ok", "note": ""})
    pd.DataFrame(rows).to_csv(path, index=False)


def test_rescaling_audit_is_in_the_report(tmp_path):
    exp = write_experiment(tmp_path, "audited")
    (exp / "audit_draws").mkdir()
    _audit_csv(exp / "audit_draws" / "audit_correlations.csv")
    write_report([exp], exp, n_boot=50, echo=lambda _: None)
    md = (exp / "report.md").read_text()
    audit = _section(md, "Rescaling audit")
    assert "`audit_draws/audit_correlations.csv`" in audit and "3 draw(s) per run in [1/2, 2] and [1/100, 100]" in audit
    rows = [line for line in audit.splitlines() if line.startswith("| `")]
    by = {}
    for line in rows:
        by.setdefault(line.split("|")[1].strip(), []).append(line)
    assert all("holds" in line and "+0.000" in line for line in by["`tracks`"])
    assert all("breaks" in line for line in by["`noise`"])
    assert all("n/a (no transformed value)" in line for line in by["`flat`"])  # never shown as Δτ = 0
    assert all("| 8 |" in line for line in rows)  # n per cell
    verdict = _section(md, "Verdict")
    assert "node: holds" in verdict and "node: breaks 0.2" in verdict and "node: n/a" in verdict
    assert (exp / "plots" / "audit_audit_draws.png").is_file()


def test_the_verdict_tables_audit_cells_do_not_wrap(tmp_path):
    """The audit column's cells ("layer: holds; node: breaks 0.2") are one line each: they carry the nowrap
    class, which the page's style keeps on one line (the browser test checks the rendered line count)."""
    from flatbench.analysis.html_assets import CSS

    exp = write_experiment(tmp_path, "audited")
    (exp / "audit_draws").mkdir()
    _audit_csv(exp / "audit_draws" / "audit_correlations.csv")
    layer = pd.read_csv(exp / "audit_draws" / "audit_correlations.csv").assign(family="layer")
    (exp / "audit_layer").mkdir()
    layer.to_csv(exp / "audit_layer" / "audit_correlations.csv", index=False)
    write_report([exp], exp, n_boot=50, echo=lambda _: None)
    page = (exp / "report.html").read_text()
    table = page[page.index('<table id="verdict"'):]
    table = table[:table.index("</table>")]
    cells = re.findall(r'<td class="nowrap">([^<]*)</td>', table)
    assert "layer: breaks 0.2; node: breaks 0.2" in cells and "layer: holds; node: holds" in cells
    assert len(cells) == table.count("<tr") - 1  # one in every row (measures and references) but the header
    assert "td.nowrap{white-space:nowrap}" in CSS


def test_per_model_delta_tau_separates_a_block_move_from_the_order_within_models(tmp_path):
    """A rescaling that moves one model's values as a block changes the pooled τ but no model's own τ:
    `per_model_deltas` gives Δτ 0 for each model where the pooled Δτ is not 0."""
    from flatbench.analysis.audit_models import per_model_deltas
    from flatbench.analysis.stats import kendall_batch

    rows, models = [], {}
    for i in range(12):
        model = "a" if i < 6 else "b"
        run = f"r{i}"
        models[run] = model
        gap = (i % 6) / 10 + (0.05 if model == "b" else 0.0)
        value = gap + (10.0 if model == "a" else 0.0)  # within each model the value follows the gap
        for draw in range(2):
            moved = value * (100.0 if model == "b" else 1.0)  # model b's values moved above model a's
            rows.append({"run_id": run, "measure": "m", "family": "node", "max_factor": 100.0, "draw": draw,
                         "original": value, "transformed": moved, "gap": gap})
    frame = pd.DataFrame(rows)
    frame.to_csv(tmp_path / "audit_population.csv", index=False)
    one = frame[frame["draw"] == 0]
    pooled = (kendall_batch(one["transformed"].to_numpy(float), one["gap"].to_numpy(float))[0]
              - kendall_batch(one["original"].to_numpy(float), one["gap"].to_numpy(float))[0])
    assert abs(pooled) > 0.1
    per_model = per_model_deltas(tmp_path, models, {"m": True})
    assert sorted(per_model["model"]) == ["a", "b"] and (per_model["n"] == 6).all()
    assert (per_model["delta_mean"].abs() < 1e-12).all() and (per_model["delta_absmax"].abs() < 1e-12).all()


COMMITTED = Path(__file__).resolve().parents[2] / "results" / "cpu"


def test_the_committed_reports_show_delta_tau_per_model_and_the_layer_wise_audit():
    """Issue 28: the study that pools models (tsuzuku_mnist: lenet and mlp) has Δτ within each model for every
    audited measure and range, and Ibayashi et al.'s report has its layer-wise audit (audit_layer/) next to
    the node-wise one, as a table and a figure."""
    md = (COMMITTED / "tsuzuku_mnist" / "report.md").read_text()
    audit = _section(md, "Rescaling audit")
    head = "| measure | factor range | pooled Δτ | Δτ `lenet` | Δτ `mlp` |"
    assert head in audit
    table = audit[audit.index(head):].split("\n\n")[0].splitlines()[2:]
    corr = pd.read_csv(COMMITTED / "tsuzuku_mnist" / "audit_correlations.csv")
    assert len(table) == len(corr)
    finite = [line for line in table if re.search(r"\(max [0-9.]+, n 12\) \| [+-][0-9.]+ \(max [0-9.]+, n 12\) \|$", line)]
    assert len(finite) >= len(table) // 2
    ib = _section((COMMITTED / "ibayashi_mnist" / "report.md").read_text(), "Rescaling audit")
    assert "`audit_layer/audit_correlations.csv`: layer rescaling" in ib and "plots/audit_audit_layer.png" in ib
    assert "`audit_correlations.csv`: node rescaling" in ib
    assert (COMMITTED / "ibayashi_mnist" / "plots" / "audit_audit_layer.png").is_file()
