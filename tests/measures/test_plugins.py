"""Measure plugins from outside the package, through the real command line: a plugin file in a temporary
folder (never imported by flatbench itself) runs through a study, the report, the audit and
check-measure; an edited plugin recomputes its entries only; clashes and missing plugins are one line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import cli_ok, cli_one_line_error, run_cli

MARGIN = '''
import torch
from flatbench import MeasureContext, NotApplicable, register_measure

@register_measure("logit_margin", description="mean margin f_y - max_(c != y) f_c (a test plugin)",
                  invariant_to=("layer", "node", "bn"), cost="cheap", larger_is_sharper=False)
def logit_margin(ctx: MeasureContext) -> dict[str, float]:
    with torch.no_grad():
        f = ctx.model(ctx.inputs)
    true = f.gather(1, ctx.targets[:, None])[:, 0]
    other = f.scatter(1, ctx.targets[:, None], float("-inf")).max(dim=1).values
    return {"logit_margin": SCALE * float((true - other).mean())}
'''


def _plugin(folder: Path, name: str, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return path




def test_a_plugin_runs_through_a_study_the_report_the_audit_and_check_measure(tmp_path, write_config):
    plugin = _plugin(tmp_path / "elsewhere", "my_measures.py", "SCALE = 1.0\n" + MARGIN)
    config = write_config({"data": {"random_label_ratio": [0.0, 0.5, 1.0], "n_train": 200, "n_test": 100},
                           "measure": {"measures": ["frobenius_norm", "logit_margin"], "n_examples": 100,
                                       "plugins": [str(plugin)]}, "out": str(tmp_path / "results")})
    out = cli_ok(run_cli("run", str(config), "--quiet"))
    exp = tmp_path / "results" / "tiny"
    runs = sorted(p for p in (exp / "runs").iterdir() if p.is_dir())
    assert len(runs) == 3
    entries = json.loads((runs[0] / "measures.json").read_text())
    margin = entries["logit_margin"]
    assert margin["status"] == "ok" and margin["larger_is_sharper"] is False
    assert margin["plugin"]["source"] == str(plugin.resolve()) and len(margin["plugin"]["sha256"]) == 64
    assert "plugin" not in entries["frobenius_norm"]  # built-in entries are unchanged by plugins
    assert "logit_margin" in (exp / "correlations.csv").read_text()
    assert "logit_margin" in (exp / "report.md").read_text() and "report" in out

    # the saved study names its plugin: the audit finds it without --plugin
    cli_ok(run_cli("audit", str(runs[0]), "--families", "node,logit_scale", "--trials", "1",
                "--measures", "logit_margin", "--out", str(tmp_path / "audit")))
    audit = (tmp_path / "audit" / "audit.csv").read_text()
    assert "logit_margin" in audit and "node" in audit

    # an edited plugin recomputes its own entries, and only those
    before = {r: json.loads((r / "measures.json").read_text()) for r in runs}
    plugin.write_text(textwrap.dedent("SCALE = 2.0\n" + MARGIN))
    cli_ok(run_cli("measure", str(exp), "--quiet", "measure.workers=2"))  # worker processes load it too
    for run in runs:
        after = json.loads((run / "measures.json").read_text())
        assert after["frobenius_norm"] == before[run]["frobenius_norm"]
        assert after["logit_margin"]["plugin"]["sha256"] != before[run]["logit_margin"]["plugin"]["sha256"]
        assert after["logit_margin"]["values"]["logit_margin"] == pytest.approx(
            2 * before[run]["logit_margin"]["values"]["logit_margin"], rel=1e-9)

    # status knows the study's plugin measures: a run without its logit_margin entry is not measured
    entries = json.loads((runs[2] / "measures.json").read_text())
    del entries["logit_margin"]
    (runs[2] / "measures.json").write_text(json.dumps(entries))
    assert json.loads(cli_ok(run_cli("status", str(exp), "--json")))["measured"] == 2

    checked = cli_ok(run_cli("check-measure", "logit_margin", "--plugin", str(plugin), "--cases", "mlp,mlp_bn"))
    assert "passed: logit_margin" in checked and "logit_scale" in checked.split("undeclared families that break it")[1]


def test_check_measure_catches_a_declared_invariance_the_measure_lacks(tmp_path):
    liar = _plugin(tmp_path / "p", "liar.py", '''
        from flatbench import register_measure

        @register_measure("weight_l1", description="Σ|θ|", invariant_to=("node",), cost="cheap")
        def weight_l1(ctx):
            return {"weight_l1": sum(float(p.detach().abs().sum()) for p in ctx.model.parameters())}
    ''')
    result = run_cli("check-measure", "weight_l1", "--plugin", str(liar), "--cases", "mlp")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED: weight_l1: declared invariant to node" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("mlp ") and " node " in line)
    assert row.split()[-1] == "FAIL"
    assert "undeclared families that break it: layer, logit_scale" in result.stdout


def test_plugin_clash_is_one_line(tmp_path):
    clash = _plugin(tmp_path / "p", "clash.py", '''
        from flatbench import register_measure

        @register_measure("path_norm", description="mine", cost="cheap")
        def path_norm(ctx):
            return {"path_norm": 0.0}
    ''')
    cli_one_line_error(run_cli("list-measures", "--plugin", str(clash)), "'path_norm'", "clashes with a built-in measure")


def test_plugin_problems_name_the_plugin(tmp_path, own_registry):
    import flatbench
    from flatbench.errors import FlatbenchError

    with pytest.raises(FlatbenchError, match="nope.py does not exist"):
        flatbench.load_plugins([str(tmp_path / "nope.py")])
    with pytest.raises(FlatbenchError, match="'no_such_module_xyz' cannot be found"):
        flatbench.load_plugins(["no_such_module_xyz"])
    broken = _plugin(tmp_path / "p", "broken.py", "raise ValueError('boom')\n")
    with pytest.raises(FlatbenchError, match=r"plugin .*broken.py failed to import: ValueError: boom \(broken.py:1\)"):
        flatbench.load_plugins([str(broken)])


def test_a_nondeterministic_measure_without_a_standard_error_fails_the_check(tmp_path, own_registry):
    import flatbench
    from flatbench.measures.contract import check_measure

    # A value that differs on every call, by at least a factor 1.5, so that the undeclared family's row reads
    # "breaks" whatever the draw (random.random() twice could land within CHANGE_REL and read "holds").
    noisy = _plugin(tmp_path / "p", "noisy.py", '''
        import itertools
        from flatbench import register_measure

        calls = itertools.count(2)

        @register_measure("noisy", description="a different number on every call", cost="cheap")
        def noisy(ctx):
            return {"noisy": float(next(calls)) ** 2}
    ''')
    flatbench.load_plugins([str(noisy)])
    report = check_measure("noisy", cases=("mlp",), families=("layer",))
    assert any("nondeterministic" in p for p in report.problems), report.problems
    assert [r.verdict for r in report.rows] == ["FAIL", "breaks"]


def test_module_plugins_and_entry_points(tmp_path):
    """A plugin as an importable module (--plugin mypkg.measures) and one offered by an installed
    package's `flatbench.measures` entry point, listed with where they come from."""
    pkg = tmp_path / "site" / "mypkg"
    _plugin(pkg, "__init__.py", "")
    _plugin(pkg, "measures.py", '''
        from flatbench import register_measure

        @register_measure("n_params", description="number of parameters", cost="cheap")
        def n_params(ctx):
            return {"n_params": float(sum(p.numel() for p in ctx.model.parameters()))}
    ''')
    _plugin(pkg, "installed.py", '''
        from flatbench import register_measure

        @register_measure("n_tensors", description="number of parameter tensors", cost="cheap")
        def n_tensors(ctx):
            return {"n_tensors": float(len(list(ctx.model.parameters())))}
    ''')
    dist = tmp_path / "site" / "mypkg-0.1.dist-info"
    _plugin(dist, "METADATA", "Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    _plugin(dist, "entry_points.txt", "[flatbench.measures]\ninstalled = mypkg.installed\n")
    env = {"PYTHONPATH": str(tmp_path / "site")}
    listing = cli_ok(run_cli("list-measures", "--plugin", "mypkg.measures", env=env))
    assert any(line.startswith("n_params ") and "[plugin: mypkg.measures]" in line for line in listing.splitlines())
    assert any(line.startswith("n_tensors ") and "[plugin: mypkg.installed]" in line for line in listing.splitlines())


def test_loading_in_process_origin_family_and_an_edited_file(tmp_path, own_registry):
    """`flatbench.load_plugins`: what a plugin measure records of where it comes from (its file, the file's
    sha256, the report's family: the plugin's name unless it names one); loading twice is a no-op; an
    edited file replaces its measures."""
    import hashlib

    import flatbench
    from flatbench.measures import get_measure

    path = _plugin(tmp_path / "own", "curv_plugin.py", '''
        from flatbench import register_measure

        @register_measure("plugin_a", description="a", cost="cheap")
        def plugin_a(ctx):
            return {"plugin_a": 1.0}

        @register_measure("plugin_b", description="b", cost="cheap", family="curvature")
        def plugin_b(ctx):
            return {"plugin_b": 2.0}
    ''')
    assert flatbench.load_plugins([str(path)]) == ["plugin_a", "plugin_b"]
    a = get_measure("plugin_a")
    assert a.origin == str(path.resolve()) and a.origin_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (a.family, get_measure("plugin_b").family, get_measure("path_norm").family) == ("curv_plugin", "curvature", "norm")
    assert flatbench.load_plugins([str(path)]) == []
    path.write_text(path.read_text().replace('"plugin_a": 1.0', '"plugin_a": 3.0'))
    flatbench.load_plugins([str(path)])
    assert get_measure("plugin_a").origin_sha256 == hashlib.sha256(path.read_bytes()).hexdigest() != a.origin_sha256
    assert get_measure("plugin_a").fn(None) == {"plugin_a": 3.0}


def test_a_plugin_may_return_a_bare_number_and_skip_the_description(tmp_path, own_registry):
    import torch
    from torch import nn

    import flatbench
    from flatbench.measures import get_measure

    path = _plugin(tmp_path / "own", "terse.py", '''
        from flatbench import register_measure

        @register_measure("n_weights", invariant_to=("node",))
        def n_weights(ctx):
            """How many parameters the model has."""
            return sum(p.numel() for p in ctx.model.parameters())

        @register_measure("bad_return")
        def bad_return(ctx):
            return "three"
    ''')
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    df = flatbench.measure(model, (torch.randn(5, 4), torch.arange(5) % 2), ["n_weights", "bad_return"],
                           plugins=[str(path)])
    assert get_measure("n_weights").description == "How many parameters the model has."
    assert df.loc[0, "value"] == 23.0 and df.loc[0, "status"] == "ok"
    assert df.loc[1, "status"] == "error" and "return a number, a dict of values or a MeasureOutput" in df.loc[1, "reason"]


def test_a_built_in_measure_names_its_family_and_its_papers_at_registration(own_registry):
    """Issue 43: a measure's family (the report's grouping) and papers (its reference page) are arguments of
    its registration, kept on its spec; there is no table elsewhere to keep in step."""
    from flatbench.analysis.families import FAMILY_ORDER
    from flatbench.errors import FlatbenchError
    from flatbench.measures.reference_page import measure_page
    from flatbench.measures.registry import all_measures, register_measure

    builtin = {n: s for n, s in all_measures().items() if s.origin == "builtin"}
    assert builtin and all(s.family in FAMILY_ORDER for s in builtin.values()), \
        {n: s.family for n, s in builtin.items()}
    assert builtin["path_norm"].papers[0].startswith("Neyshabur, Tomioka, Srebro")
    assert "- Neyshabur, Tomioka, Srebro" in measure_page("path_norm")

    def unnamed(ctx):
        return 0.0

    unnamed.__module__ = "flatbench.measures.builtin.unnamed"
    with pytest.raises(FlatbenchError, match="a built-in measure names its family"):
        register_measure("unnamed_builtin")(unnamed)
    with pytest.raises(FlatbenchError, match="papers must be a tuple of citations"):
        register_measure("one_string", papers="Jiang et al. 2020")(lambda ctx: 0.0)
