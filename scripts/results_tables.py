"""Print the tables of the results pages (docs/results/*.md) from a committed study's files (so the README's numbers are copied,
never typed).

    python scripts/results_tables.py results/cpu/tsuzuku_mnist            # ranking, by level, audit
    python scripts/results_tables.py results/cpu/tsuzuku_mnist --only ranking
    python scripts/results_tables.py --update docs/results/*.md     # refill every marked table in place

In `--update` mode every block between `<!-- table: STUDY SECTION -->` and `<!-- end -->` in the file is
replaced by that section of results/cpu/STUDY, so the README's tables are regenerated, never edited by hand.

Reads correlations.csv (the ranking: τ with its interval, p-value, n, the comparison with the best),
correlations_by_level.csv (τ at every snapshot level), audit_correlations.csv (the population audit: τ before
and after random node-wise rescalings of every run: several draws per factor range, or one draw in the files
of the old audit), table.csv (the runs' final train losses) and
walltime.txt (the commands and their wall times, written by scripts/run_cpu_studies.sh).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import pandas as pd


def f(value: object, digits: int = 2) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "n/a"
    return f"{v:.{digits}f}" if math.isfinite(v) else "n/a"


def p_text(value: object) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "n/a"
    if not math.isfinite(v):
        return "n/a"
    return "<0.001" if v < 0.001 else f"{v:.2g}"  # as the report writes p


def _group(r: dict) -> str:
    """The measure's label against the study's best (Holm-adjusted paired tests), '(borderline)' where the
    adjusted p is within Monte-Carlo error of the level, so that another report seed could flip it."""
    label = r.get("vs_best") if isinstance(r.get("vs_best"), str) else ""
    if str(r.get("vs_best_borderline")).lower() == "true":
        label += " (borderline)"
    return label


def _in_group(r: dict) -> bool:
    return str(r.get("vs_best")) in ("best", "indistinguishable")


def _share(value: object, n: object) -> str:
    try:
        count = int(float(n))
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if count == 0 or not math.isfinite(float(value)) else f"{float(value):.2f} ({count})"


def _baseline(r: dict) -> str:
    """"beats: +0.12 [0.03, 0.20]" / "no: −0.18 [−0.24, −0.12]" against ref.hyperparameters (issue 42)."""
    diff = float(r.get("vs_hyperparameters", math.nan))
    if not math.isfinite(diff):
        return ""
    lo, hi = float(r.get("vs_hyperparameters_lo", math.nan)), float(r.get("vs_hyperparameters_hi", math.nan))
    beats = str(r.get("beats_hyperparameters")) == "True"
    return f"{'beats' if beats else 'no'}: {f(diff)}" + (f" [{f(lo)}, {f(hi)}]" if math.isfinite(lo) else "")


def blocking(exp: Path) -> str:
    """gap ~ draw + configuration (variance.csv): the draw's share of the variance and the cells' partial ω²."""
    frame = pd.read_csv(exp / "variance.csv")
    lines = ["| effect | df | share of the variance | F | partial ω² |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in frame.to_dict(orient="records"):
        lines.append(f"| {r['effect']} | {int(r['df'])} | {float(r['share']):.4f} | {f(r['F'])} | "
                     f"{f(r['partial_omega2'])} |")
    return "\n".join(lines)


def ranking(exp: Path) -> str:
    """Every measure with τ [interval], p, its group (Holm over the paired tests against the best), the
    share of seed pairs it orders like the gap, Ψ and the mean / worst sign error."""
    corr = pd.read_csv(exp / "correlations.csv")
    lines = ["| # | measure | n | τ within draws [95% CI] | pooled τ | within-cell τ | vs ref.hyperparameters: Δτ "
             "[95% CI] | p | vs best (Holm) | seed pairs ordered (n) | Ψ | sign error mean / worst | Spearman ρ | "
             "Pearson r |",
             "| ---: | --- | ---: | --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(corr.to_dict(orient="records"), 1):
        ci = f" [{f(r['kendall_tau_lo'])}, {f(r['kendall_tau_hi'])}]" if math.isfinite(float(r["kendall_tau_lo"])) else ""
        is_ref = r.get("kind") == "reference"
        name = f"`{r['measure']}`" + (" (reference)" if is_ref else "")
        lines.append(f"| {'' if is_ref else i} | {name} | {r['n']} | {f(r['kendall_tau'])}{ci} | "
                     f"{f(r.get('kendall_tau_pooled'))} | {f(r.get('kendall_tau_within_cell'))} | {_baseline(r)} | "
                     f"{p_text(r['kendall_p'])} | {_group(r)} | {_share(r.get('seed_pairs_concordant'), r.get('n_seed_pairs'))} | "
                     f"{f(r.get('psi'))} | {f(r.get('sign_error_mean'))} / {f(r.get('sign_error_worst'))} | "
                     f"{f(r['spearman_rho'])} | {f(r['pearson_r'])} |")
    methods = sorted(set(corr["kendall_p_method"].dropna().astype(str))) if "kendall_p_method" in corr else []
    if methods:
        lines.append("")
        lines.append("p: two-sided permutation test of τ (" + "; ".join(methods) + ").")
    return "\n".join(lines)


def axes(exp: Path) -> str:
    """Beyond label noise: per measure, one ψ per axis (Jiang et al.'s granulated τ, within blocks that share
    every other axis and the data draw) with its Holm-adjusted p (over every ψ test of the study), Ψ over
    the training axes, psi_data over the data axes, the CMI score with its minimizing conditioning set,
    Dziugaite et al.'s noise-filtered sign errors over the environments, and the replicate pairs."""
    corr = pd.read_csv(exp / "correlations.csv")
    names = [c[len("psi_"):] for c in corr.columns
             if c.startswith("psi_") and c != "psi_data" and not c.startswith("psi_p_")]
    head = "| measure | τ | " + " | ".join(f"ψ `{n}` (p Holm)" for n in names) + \
        " | Ψ (training) | psi_data | CMI (given) | sign error mean / worst (environments) | replicate pairs ordered (n, p) |"
    lines = [head, "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | --- | ---: | ---: |"]
    for r in corr.to_dict(orient="records"):
        cmi = f(r.get("cmi"))
        if cmi != "n/a" and isinstance(r.get("cmi_condition"), str):
            cmi += f" ({r['cmi_condition']})"
        envs = r.get("n_environments")
        envs = int(envs) if isinstance(envs, (int, float)) and math.isfinite(float(envs)) else 0
        psis = [f"{f(r[f'psi_{n}'])} ({p_text(r.get(f'p_psi_holm_{n}'))})" for n in names]
        seeds = _share(r.get("seed_pairs_concordant"), r.get("n_seed_pairs"))
        if seeds != "n/a":
            seeds = seeds[:-1] + f", p {p_text(r.get('seed_pairs_p'))})"
        name = f"`{r['measure']}`" + (" (reference)" if r.get("kind") == "reference" else "")
        lines.append(f"| {name} | {f(r['kendall_tau'])} | " + " | ".join(psis)
                     + f" | {f(r.get('psi'))} | {f(r.get('psi_data'))} | {cmi} | {f(r.get('sign_error_mean'))} / "
                     f"{f(r.get('sign_error_worst'))} ({envs}) | {seeds} |")
    return "\n".join(lines)


def bands(exp: Path) -> str:
    """The floor: the pure-noise reference's mean and 95% band of every statistic (reference_bands.csv)."""
    frame = pd.read_csv(exp / "reference_bands.csv")
    lines = ["| statistic | pure-noise mean | 95% band |", "| --- | ---: | --- |"]
    for r in frame.to_dict(orient="records"):
        if not math.isfinite(float(r["mean"])):
            continue
        lines.append(f"| {r['statistic']} | {f(r['mean'])} | [{f(r['q025'])}, {f(r['q975'])}] |")
    return "\n".join(lines)


PAIRS = [
    ("normalized_sharpness_nce", "hessian_trace", "Tsuzuku et al.'s protocol: normalized sharpness of the "
     "normalized cross-entropy, Hessian trace of the cross-entropy"),
    ("normalized_sharpness", "hessian_trace", "both on the cross-entropy"),
    ("normalized_sharpness_nce", "hessian_trace@normalized_ce", "both on the normalized cross-entropy"),
    ("normalized_sharpness_nce", "normalized_sharpness", "the loss the normalized sharpness is taken of"),
    ("path_norm", "normalized_sharpness_nce", "two node-invariant measures"),
    ("adaptive_sharpness_avg@normalized_ce", "normalized_sharpness_nce", "two node-invariant measures"),
    ("minimum_sharpness", "normalized_sharpness", "Ibayashi et al.'s claim (exact solvers)"),
    ("minimum_sharpness:published", "normalized_sharpness:published", "Ibayashi et al.'s claim (published "
     "solvers)"),
    ("psi_flatness", "hessian_trace", "Yi et al.'s invariant trace against the plain one"),
]
"""The paired comparisons the prose of the results pages cites (A − B), with the pairing each one uses."""


def pairs(exp: Path) -> str:
    """Paired comparisons of τ (comparisons.csv: the bootstrap over the runs both measures have, with the
    Wald p of the difference and the resample-count p) for the pairs in `PAIRS` that the study has."""
    comp = pd.read_csv(exp / "comparisons.csv")
    index = {(r["measure_a"], r["measure_b"]): r for r in comp.to_dict(orient="records")}
    lines = ["| A | B | pairing | n | τ_A | τ_B | Δτ = τ_A − τ_B [95% CI] | p (Wald) | p (bootstrap) |",
             "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for a, b, what in PAIRS:
        r = index.get((a, b))
        if r is None or not int(r["n"]):
            continue
        ci = f" [{f(r['diff_lo'])}, {f(r['diff_hi'])}]" if math.isfinite(float(r["diff_lo"])) else ""
        lines.append(f"| `{a}` | `{b}` | {what} | {r['n']} | {f(r['tau_a'])} | {f(r['tau_b'])} | "
                     f"{f(r['diff'])}{ci} | {p_text(r['p_value'])} | {p_text(r['p_boot'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _gap_variance():
    """scripts/gap_variance.py as a module (a script beside this one, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gap_variance", Path(__file__).with_name("gap_variance.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variance(exp: Path, gap: str | None = None) -> str:
    """The share of the gap's variance each axis explains (scripts/gap_variance.py); the study's gap unless
    `gap` is given."""
    module = _gap_variance()
    gap = gap or module.study_gap(exp)
    n, rows = module.shares(exp, gap)
    what = {"acc": "accuracy gap", "loss": "loss gap (test − train cross-entropy)"}[gap]
    lines = [f"| share of the variance of the {what} ({n} runs) | |", "| --- | ---: |"]
    lines += [f"| {what} | {share:.4f} |" for what, share in rows]
    return "\n".join(lines)


def levels(exp: Path) -> str:
    path = exp / "correlations_by_level.csv"
    if not path.is_file():
        return ""
    frame = pd.read_csv(path)
    cols = list(dict.fromkeys(frame["level"].astype(str)))
    lookup = {(r["measure"], str(r["level"])): r for r in frame.to_dict(orient="records")}
    measures = [m for m in dict.fromkeys(frame["measure"]) if any(
        math.isfinite(float(lookup.get((m, c), {}).get("kendall_tau", math.nan))) for c in cols if c != "final")]
    head = "| measure | " + " | ".join(f"loss ≤ {c}" if c != "final" else "final" for c in cols) + " |"
    lines = [head, "| --- |" + " ---: |" * len(cols)]
    for m in measures:
        cells = []
        for c in cols:
            r = lookup.get((m, c))
            cells.append("n/a" if r is None else f"{f(r['kendall_tau'])} (n {int(r['n'])})")
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _old_audit_range(exp: Path) -> str:
    """The factor range an old (single-draw) audit printed in its log, e.g. 'factors log-uniform in [1/100, 100]'."""
    import re

    for log in (exp / "audit.log", exp.parent / f"{exp.name}.log"):  # a study's, or a sub-audit's (audit_layer)
        match = re.search(r"factors log-uniform in (\[1/[0-9.e+]+, [0-9.e+]+\])", log.read_text()) \
            if log.is_file() else None
        if match:
            return f"factors log-uniform in {match.group(1)}"
    return "factor range not recorded"


def audit(exp: Path) -> str:
    """The population audit: one row per measure. A current audit_correlations.csv (one row per measure and
    factor range, Δτ over several draws) gives, for each range, the mean Δτ and its [min, max] over the
    draws; a file of the old audit (one transformation per run) is printed as it was, captioned
    'single draw (old audit)'."""
    path = exp / "audit_correlations.csv"
    if not path.is_file():
        return ""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flatbench.analysis.audit_tables import runs_per_range

    frame = pd.read_csv(path)
    family = "/".join(sorted(set(frame["family"].astype(str)))) if "family" in frame else "node"
    if "max_factor" not in frame:  # the old single-draw audit
        lines = [f"| measure | n | τ before | τ after | Δτ | median relative change | declared {family}-invariant |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in frame.to_dict(orient="records"):
            rel = float(r["median_rel_change"])
            lines.append(f"| `{r['measure']}` | {r['n']} | {f(r['tau_original'])} | {f(r['tau_transformed'])} | "
                         f"{f(r['delta'])} | {'n/a' if not math.isfinite(rel) else f'{rel:.1e}'} | "
                         f"{'yes' if r['declared_invariant'] else 'no'} |")
        lines.append("")
        lines.append(f"Single draw (old audit): one {family} transformation per run, {_old_audit_range(exp)}.")
        return "\n".join(lines)
    factors = sorted(set(frame["max_factor"].astype(float)))
    draws = int(frame["n_draws"].max())
    lines = ["| measure | n | τ before | " + " | ".join(f"Δτ, F = {x:g}: mean [min, max]" for x in factors)
             + " | median relative change (" + " / ".join(f"F = {x:g}" for x in factors) + ")"
             + f" | declared {family}-invariant |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in factors) + " | ---: | --- |"]
    for measure in dict.fromkeys(frame["measure"]):
        part = {float(r["max_factor"]): r for r in frame[frame["measure"] == measure].to_dict(orient="records")}
        first = next(iter(part.values()))
        cells, rels, counts = [], [], []
        for x in factors:
            r = part.get(x)
            counts.append(int(r["n"]) if r is not None else 0)
            if r is None or not math.isfinite(float(r["delta_mean"])):
                note = r.get("note") if r is not None else None  # e.g. "error on 66 of 66 copies", where the
                why = note if isinstance(note, str) and not note.startswith(str(r["status"])) else (r or {}).get("status")  # status alone says less
                cells.append("n/a" if r is None else f"n/a ({why})")
            else:
                partial = f" ({int(r['n_draws_ok'])} of {int(r['n_draws'])} draws)" \
                    if int(r["n_draws_ok"]) < int(r["n_draws"]) else ""
                cells.append(f"{f(r['delta_mean'])} [{f(r['delta_min'])}, {f(r['delta_max'])}]{partial}")
            rel = float(r["median_rel_change"]) if r is not None else math.nan
            rels.append("n/a" if not math.isfinite(rel) else f"{rel:.1e}")
        lines.append(f"| `{measure}` | {runs_per_range(counts)} | {f(first['tau_original'])} | " + " | ".join(cells) + " | "
                     + " / ".join(rels) + f" | {'yes' if first['declared_invariant'] else 'no'} |")
    lines.append("")
    lines.append(f"{draws} random {family} transformations of every run for each factor range [1/F, F]; Δτ = τ after − "
                 "τ before, one value per draw; the median relative change of the values is given per range; n is "
                 "the runs with a value, per range (" + " / ".join(f"F = {x:g}" for x in factors) + ") where they differ.")
    return "\n".join(lines)


def endpoint(exp: Path) -> str:
    table = pd.read_csv(exp / "table.csv")
    loss = table["train_loss"].astype(float)
    reached = table["reached_target"].astype(str).str.lower().eq("true").sum() if "reached_target" in table else "n/a"
    return (f"{len(table)} runs; final train loss {loss.min():.3g} to {loss.max():.3g} "
            f"({loss.max() / loss.min():.2g}x); {reached} of {len(table)} reached the target; train accuracy "
            f"{table['train_acc'].min():.4f} to {table['train_acc'].max():.4f}; gap {table['gap_acc'].min():.3f} "
            f"to {table['gap_acc'].max():.3f}")


def by_model(exp: Path) -> str:
    """Kendall τ of every measure on each model's runs alone (when the study has several models): a τ
    pooled over architectures also ranks the architectures, which a measure's scale can win or lose."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flatbench.analysis.stats import analyze
    from flatbench.analysis.table import build_table, load_records

    records = load_records([exp])
    models = sorted({(r.info.get("config") or {}).get("model", {}).get("name") for r in records})
    if len(models) < 2:
        return ""
    columns = {}
    for model in models:
        recs = [r for r in records if (r.info.get("config") or {}).get("model", {}).get("name") == model]
        corr = analyze(build_table([exp], records=recs), n_boot=1000, seed=0).correlations
        columns[model] = {r["measure"]: r for r in corr.to_dict(orient="records")}
    pooled = pd.read_csv(exp / "correlations.csv")
    order = [m for m in pooled["measure"] if any(math.isfinite(float(columns[x].get(m, {}).get("kendall_tau", math.nan)))
                                                 for x in models)]
    lines = ["| measure | τ of both models (within draws) | " + " | ".join(f"τ {m} [95% CI where computed], p"
                                                                       for m in models) + " |",
             "| --- | ---: |" + " --- |" * len(models)]
    pooled_tau = dict(zip(pooled["measure"], pooled["kendall_tau"]))
    for m in order:
        cells = []
        for model in models:
            r = columns[model].get(m)
            if r is None or not math.isfinite(float(r["kendall_tau"])):
                cells.append("n/a")
                continue
            ci = f" [{f(r['kendall_tau_lo'])}, {f(r['kendall_tau_hi'])}]" if math.isfinite(float(r["kendall_tau_lo"])) else ""
            cells.append(f"{f(r['kendall_tau'])}{ci}, {p_text(r['kendall_p'])}")
        lines.append(f"| `{m}` | {f(pooled_tau.get(m))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def levels_by_model(exp: Path) -> str:
    """Each measure's τ at every snapshot level and at the final models, on each model's runs alone, with
    the train-loss range of the runs at each level (the README's "Training endpoint" table)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flatbench.analysis.report import level_correlations
    from flatbench.analysis.stats import analyze
    from flatbench.analysis.table import build_table, level_tables, load_records, snapshot_records

    records = load_records([exp])
    if not any(r.info.get("snapshots") for r in records):
        return ""
    models = sorted({(r.info.get("config") or {}).get("model", {}).get("name") for r in records})
    out = []
    for model in models:
        recs = [r for r in records if (r.info.get("config") or {}).get("model", {}).get("name") == model]
        final = analyze(build_table([exp], records=recs), n_boot=0, seed=0).correlations
        snapshots = snapshot_records(recs)
        frame = level_correlations(level_tables(snapshots), n_boot=0, final=final)
        losses = {lv: [float(r.info["train_loss"]) for r in rs] for lv, rs in snapshots.items()}
        losses["final"] = [float(r.info["train_loss"]) for r in recs]
        cols = list(dict.fromkeys(frame["level"].astype(str)))
        lookup = {(r["measure"], str(r["level"])): r for r in frame.to_dict(orient="records")}
        keys = {str(k): v for k, v in losses.items()}
        head = f"| {model} | " + " | ".join(
            f"loss ≤ {c} ({min(keys[c]):.2g} to {max(keys[c]):.2g})" if c != "final" else
            f"final ({min(keys[c]):.2g} to {max(keys[c]):.2g})" for c in cols) + " |"
        out += [head, "| --- |" + " ---: |" * len(cols)]
        for m in dict.fromkeys(frame[frame["level"].astype(str) != "final"]["measure"]):
            cells = [f(lookup[(m, c)]["kendall_tau"]) if (m, c) in lookup else "n/a" for c in cols]
            if all(c == "n/a" for c in cells[:-1]):
                continue
            out.append(f"| `{m}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def solvers(exp: Path) -> str:
    """The exact solvers beside the published procedure (10,000 SGD steps, `:published`): τ and seconds per
    model of each, and how far above the exact optimum the published values end (median ratio)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flatbench.analysis.table import load_records

    corr = pd.read_csv(exp / "correlations.csv").set_index("measure")
    records = load_records([exp])

    def seconds(key: str) -> float:
        vals = [float(r.measures[key]["seconds"]) for r in records if key in r.measures]
        return sum(vals) / len(vals) if vals else math.nan

    def value(r, key: str) -> float:
        entry = r.measures.get(key, {})
        return float(entry.get("values", {}).get(key, math.nan)) if entry.get("status") == "ok" else math.nan

    lines = [(f"The shared exact Hessian diagonal (the time of `hessian_trace`, which computes it): "
             f"{seconds('hessian_trace'):.2f} s per model."), "",
             ("| measure | τ exact solver | τ published solver | published / exact (median) | s per model exact | "
             "s per model published |"), "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for exact in ("minimum_sharpness", "normalized_sharpness", "normalized_sharpness_nce"):
        published = exact + ":published"
        if published not in corr.index or not math.isfinite(float(corr.loc[exact, "kendall_tau"])):
            continue
        ratios = sorted(value(r, published) / value(r, exact) for r in records
                        if math.isfinite(value(r, published) / value(r, exact)))
        median = statistics.median(ratios) if ratios else math.nan
        lines.append(f"| `{exact}` | {f(corr.loc[exact, 'kendall_tau'])} (p {p_text(corr.loc[exact, 'kendall_p'])}) | "
                     f"{f(corr.loc[published, 'kendall_tau'])} (p {p_text(corr.loc[published, 'kendall_p'])}) | "
                     f"{median:.3g} | {seconds(exact):.3f} | {seconds(published):.3f} |")
    return "\n".join(lines)


def walltime(exp: Path) -> str:
    path = exp / "walltime.txt"
    if not path.is_file():
        return ""
    rows = []
    for line in path.read_text().splitlines():
        seconds, _, command = line.partition(" s  ")
        rows.append(f"| `{command.strip()}` | {int(seconds) // 60} min {int(seconds) % 60} s |")
    return "| command | wall time |\n| --- | ---: |\n" + "\n".join(rows)


def _declared_node_invariant(key: str) -> str:
    """From the registry, for a measure no audit covered: is `node` among its declared invariances? n/a for a
    variant (`name:variant`): it shares its measure's declaration, which an early-stopped published solver
    need not hold."""
    if ":" in key.partition("@")[0]:
        return "n/a"

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flatbench.measures.keys import parse_key
    from flatbench.measures.registry import get_measure

    try:
        spec = get_measure(parse_key(key).measure)
    except Exception:  # noqa: BLE001 - a plugin measure this process cannot load
        return "n/a"
    return "yes" if "node" in spec.invariant_to else "no"


def _study_gap(exp: Path) -> str:
    return _gap_variance().study_gap(exp)


def summary(cpu: Path) -> str:
    """One row per measure, one column per study: τ with the gap (bold where the measure is in the study's
    best group: best or indistinguishable from it), whether the measure is declared node-invariant, and the
    largest |Δτ| the population audits measured under random node-wise rescalings (over every draw and factor
    range of a current audit; the one draw of an old one)."""
    studies = sorted(p.parent for p in cpu.glob("*/correlations.csv"))
    taus: dict[str, dict[str, str]] = {}
    means: dict[str, list[float]] = {}
    declared: dict[str, bool] = {}
    shift: dict[str, float] = {}
    for exp in studies:
        for r in pd.read_csv(exp / "correlations.csv").to_dict(orient="records"):
            tau = float(r["kendall_tau"])
            if not math.isfinite(tau):
                continue
            text = f"**{tau:.2f}**" if _in_group(r) else f"{tau:.2f}"
            if str(r.get("vs_best_borderline")).lower() == "true":
                text += "†"
            taus.setdefault(r["measure"], {})[exp.name] = text
            means.setdefault(r["measure"], []).append(tau)
        audit_path = exp / "audit_correlations.csv"
        if audit_path.is_file():
            audit_frame = pd.read_csv(audit_path)
            column = "delta_absmax" if "delta_absmax" in audit_frame else "delta"  # new audit: every draw and range
            for r in audit_frame.to_dict(orient="records"):
                declared[r["measure"]] = bool(r["declared_invariant"])
                d = float(r[column])
                if math.isfinite(d):
                    shift[r["measure"]] = max(shift.get(r["measure"], 0.0), abs(d))
    gaps = {e.name: _study_gap(e) for e in studies}
    header = "| measure | " + " | ".join(f"`{e.name}`" + (" (loss gap)" if gaps[e.name] == "loss" else "")
                                         for e in studies) + \
        " | mean τ | declared node-invariant | largest \\|Δτ\\| under node rescaling |"
    lines = [header, "| --- | " + " | ".join("---:" for _ in studies) + " | ---: | --- | ---: |"]
    refs = [m for m in means if m.startswith("ref.")]  # the floor and ceiling rows go last
    ranked = sorted((m for m in means if m not in refs), key=lambda k: -sum(means[k]) / len(means[k]))
    for m in ranked + sorted(refs):
        cells = [taus[m].get(e.name, "n/a") for e in studies]
        mean = sum(means[m]) / len(means[m])
        inv = ("yes" if declared[m] else "no") if m in declared else _declared_node_invariant(m)
        lines.append(f"| `{m}` | " + " | ".join(cells) + f" | {mean:.2f} | {inv} | "
                     f"{f(shift[m]) if m in shift else 'n/a'} |")
    return "\n".join(lines)


SECTIONS = {"blocking": blocking, "walltime": walltime, "endpoint": endpoint, "variance": variance, "ranking": ranking, "axes": axes,
            "bands": bands, "variance_acc": lambda exp: variance(exp, "acc"),
            "pairs": pairs,
            "by_model": by_model, "levels": levels,
            "levels_by_model": levels_by_model, "solvers": solvers, "audit": audit}


RESULTS = Path(__file__).resolve().parents[1] / "results"
"""The committed studies are in RESULTS / "cpu" / STUDY, wherever the page that shows them lies."""


def update(path: Path, root: Path = RESULTS) -> None:
    """Refill every `<!-- table: STUDY SECTION -->` ... `<!-- end -->` block of a markdown file from the
    committed studies under `root`/cpu."""
    import re

    def fill(match: re.Match) -> str:
        study, section = match.group(1), match.group(2)
        if section == "summary":  # across every committed study
            return f"<!-- table: {study} {section} -->\n{summary(root / 'cpu')}\n<!-- end -->"
        if not (root / "cpu" / study).is_dir():  # not produced yet: keep the block as it is
            return match.group(0)
        return f"<!-- table: {study} {section} -->\n{SECTIONS[section](root / 'cpu' / study)}\n<!-- end -->"

    text = path.read_text()
    new = re.sub(r"<!-- table: (\S+) (\S+) -->\n.*?<!-- end -->", fill, text, flags=re.DOTALL)
    path.write_text(new)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", nargs="?")
    p.add_argument("--only", default=None, choices=list(SECTIONS))
    p.add_argument("--update", nargs="+", default=None, help="markdown files whose marked tables to refill")
    args = p.parse_args()
    if args.update:
        for path in args.update:
            update(Path(path))
        return
    exp = Path(args.experiment)
    for name, fn in SECTIONS.items():
        if args.only in (None, name):
            text = fn(exp)
            if text:
                print(f"<!-- {name} -->\n{text}\n")


if __name__ == "__main__":
    main()
