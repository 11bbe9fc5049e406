"""Print the tables of results/README.md from a committed study's files (so the README's numbers are copied,
never typed).

    python scripts/results_tables.py results/cpu/tsuzuku_mnist            # ranking, by level, audit
    python scripts/results_tables.py results/cpu/tsuzuku_mnist --only ranking
    python scripts/results_tables.py --update results/README.md     # refill every marked table in place

In `--update` mode every block between `<!-- table: STUDY SECTION -->` and `<!-- end -->` in the file is
replaced by that section of results/cpu/STUDY, so the README's tables are regenerated, never edited by hand.

Reads correlations.csv (the ranking: τ with its interval, p-value, n, the comparison with the best),
correlations_by_level.csv (τ at every snapshot level), audit_correlations.csv (the population audit: τ before
and after one random node-wise rescaling of every run), table.csv (the runs' final train losses) and
walltime.txt (the commands and their wall times, written by scripts/run_cpu_studies.sh).
"""

from __future__ import annotations

import argparse
import math
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
    return "<0.001" if v < 0.001 else f"{v:.2g}"


def ranking(exp: Path) -> str:
    corr = pd.read_csv(exp / "correlations.csv")
    lines = ["| # | measure | n | Kendall τ [95% CI] | p | vs best | Spearman ρ | Pearson r |",
             "| ---: | --- | ---: | --- | ---: | --- | ---: | ---: |"]
    for i, r in enumerate(corr.to_dict(orient="records"), 1):
        ci = f" [{f(r['kendall_tau_lo'])}, {f(r['kendall_tau_hi'])}]" if math.isfinite(float(r["kendall_tau_lo"])) else ""
        vs = str(r.get("vs_best") if isinstance(r.get("vs_best"), str) else "")
        lines.append(f"| {i} | `{r['measure']}` | {r['n']} | {f(r['kendall_tau'])}{ci} | {p_text(r['kendall_p'])} | "
                     f"{vs} | {f(r['spearman_rho'])} | {f(r['pearson_r'])} |")
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


def audit(exp: Path) -> str:
    path = exp / "audit_correlations.csv"
    if not path.is_file():
        return ""
    frame = pd.read_csv(path)
    family = "/".join(sorted(set(frame["family"].astype(str)))) if "family" in frame else "node"
    lines = [f"| measure | n | τ before | τ after | Δτ | median relative change | declared {family}-invariant |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in frame.to_dict(orient="records"):
        rel = float(r["median_rel_change"])
        lines.append(f"| `{r['measure']}` | {r['n']} | {f(r['tau_original'])} | {f(r['tau_transformed'])} | "
                     f"{f(r['delta'])} | {'n/a' if not math.isfinite(rel) else f'{rel:.1e}'} | "
                     f"{'yes' if r['declared_invariant'] else 'no'} |")
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
    import sys

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
    lines = ["| measure | pooled τ | " + " | ".join(f"τ {m} [95% CI], p" for m in models) + " |",
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
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flatbench.analysis.report import level_correlations, snapshot_records
    from flatbench.analysis.stats import analyze
    from flatbench.analysis.table import build_table, load_records

    records = load_records([exp])
    if not any(r.info.get("snapshots") for r in records):
        return ""
    models = sorted({(r.info.get("config") or {}).get("model", {}).get("name") for r in records})
    out = []
    for model in models:
        recs = [r for r in records if (r.info.get("config") or {}).get("model", {}).get("name") == model]
        final = analyze(build_table([exp], records=recs), n_boot=0, seed=0).correlations
        frame = level_correlations(recs, n_boot=0, final=final)
        losses = {lv: [float(r.info["train_loss"]) for r in rs] for lv, rs in snapshot_records(recs).items()}
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
    import sys

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
        median = ratios[len(ratios) // 2] if ratios else math.nan
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


def summary(cpu: Path) -> str:
    """One row per measure, one column per study: τ with the gap (bold where the measure is in the study's
    best group: best or indistinguishable from it), whether the measure is declared node-invariant, and the
    largest |Δτ| the population audits measured under a random node-wise rescaling."""
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
            best = str(r.get("vs_best")) in ("best", "indistinguishable")
            taus.setdefault(r["measure"], {})[exp.name] = f"**{tau:.2f}**" if best else f"{tau:.2f}"
            means.setdefault(r["measure"], []).append(tau)
        audit_path = exp / "audit_correlations.csv"
        if audit_path.is_file():
            for r in pd.read_csv(audit_path).to_dict(orient="records"):
                declared[r["measure"]] = bool(r["declared_invariant"])
                d = float(r["delta"])
                if math.isfinite(d):
                    shift[r["measure"]] = max(shift.get(r["measure"], 0.0), abs(d))
    header = "| measure | " + " | ".join(f"`{e.name}`" for e in studies) + \
        " | mean τ | declared node-invariant | largest \\|Δτ\\| under node rescaling |"
    lines = [header, "| --- | " + " | ".join("---:" for _ in studies) + " | ---: | --- | ---: |"]
    for m in sorted(means, key=lambda k: -sum(means[k]) / len(means[k])):
        cells = [taus[m].get(e.name, "n/a") for e in studies]
        mean = sum(means[m]) / len(means[m])
        inv = "n/a" if m not in declared else ("yes" if declared[m] else "no")
        lines.append(f"| `{m}` | " + " | ".join(cells) + f" | {mean:.2f} | {inv} | "
                     f"{f(shift[m]) if m in shift else 'n/a'} |")
    return "\n".join(lines)


SECTIONS = {"walltime": walltime, "endpoint": endpoint, "ranking": ranking, "by_model": by_model, "levels": levels,
            "levels_by_model": levels_by_model, "solvers": solvers, "audit": audit}


def update(path: Path) -> None:
    """Refill every `<!-- table: STUDY SECTION -->` ... `<!-- end -->` block of a markdown file."""
    import re

    root = path.parent

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
    p.add_argument("--update", default=None, help="a markdown file whose marked tables to refill")
    args = p.parse_args()
    if args.update:
        update(Path(args.update))
        return
    exp = Path(args.experiment)
    for name, fn in SECTIONS.items():
        if args.only in (None, name):
            text = fn(exp)
            if text:
                print(f"<!-- {name} -->\n{text}\n")


if __name__ == "__main__":
    main()
