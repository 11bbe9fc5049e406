"""The package's shape: imports go one way (cli → stages → measures / analysis → training and curvature →
config, data, models, store), there is no import circle, and each rule has one home.

The import graph is read from the source (every `import` and `from ... import`, also those inside
functions), so a lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flatbench"

FLOORS = {
    "flatbench.cli": 6, "flatbench.__main__": 6,
    "flatbench.study": 5, "flatbench.api": 5, "flatbench.verification": 5,
    "flatbench.measures": 4, "flatbench.analysis": 4,
    "flatbench.training": 3, "flatbench.curvature": 3, "flatbench.rescale": 3,
    "flatbench.data": 2, "flatbench.models": 2, "flatbench.npz": 1,
    "flatbench.config": 1, "flatbench.store": 1, "flatbench.locks": 1, "flatbench.figure_png": 1, "flatbench.losses": 1,
    "flatbench.errors": 0, "flatbench.seeding": 0, "flatbench.userspec": 0, "flatbench": 0,
}
PUBLIC_API = {"flatbench.api", "flatbench.verification", "flatbench.measures.plugin", "flatbench.measures.registry"}
"""What the package's own `__init__` re-exports, lazily (`flatbench.measure`, `register_measure`, ...): its
only imports, from above everything else; importing `flatbench` itself loads only `__version__`."""
"""Each module (or package) and its floor: a module may import only from its own floor or below."""


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _floor(module: str) -> int:
    best = None
    for prefix, floor in FLOORS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, floor)
    assert best is not None, f"{module} has no floor in tests/test_structure.py"
    return best[1]


def _imports(path: Path) -> set[str]:
    """flatbench modules imported by a file; `from pkg import submodule` counts as the submodule only."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flatbench":
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if (ROOT / (f"{node.module}.{a.name}".replace(".", "/") + ".py")).is_file()
                    or (ROOT / f"{node.module}.{a.name}".replace(".", "/")).is_dir()]
            out.update(subs if len(subs) == len(node.names) else [node.module, *subs])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "flatbench")
    return out


GRAPH = {_module(p): _imports(p) - {_module(p)} for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_import(module):
    if module == "flatbench":
        assert GRAPH[module] <= PUBLIC_API, GRAPH[module]
        return
    upward = [dep for dep in GRAPH[module] if _floor(dep) > _floor(module)]
    assert not upward, f"{module} (floor {_floor(module)}) imports {upward} from above"


def test_no_import_circle():
    """No cycle among modules (a package's __init__ counts as the package itself)."""
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH.get(node, ())):
            if dep not in GRAPH:
                continue
            if seen.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in seen:
                visit(dep)
        stack.pop()
        seen[node] = 2

    for module in sorted(GRAPH):
        if module not in seen:
            visit(module)


def test_analysis_reads_files_not_the_registry():
    """The analysis floor needs no measure module: directions come from measures.json, keys from
    `measures.keys` (which imports nothing heavy)."""
    for module, deps in GRAPH.items():
        if module.startswith("flatbench.analysis"):
            assert not [d for d in deps if d.startswith("flatbench.measures") and d != "flatbench.measures.keys"], \
                (module, deps)


def test_measures_import_nothing_from_analysis():
    """Measures and analysis share a floor but are siblings: a measure's figure (the density plot) renders
    through `flatbench.figure_png`, below both, not through the report's plotting package."""
    for module, deps in GRAPH.items():
        if module.startswith("flatbench.measures"):
            assert not [d for d in deps if d.startswith("flatbench.analysis")], (module, deps)


def test_one_home_for_each_rule():
    """Rules that were once written in several places are written once."""
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}

    def where(text: str) -> list[str]:
        return sorted(str(p.relative_to(ROOT)) for p, s in sources.items() if text in s)

    assert where("STUDY_FILE).read_text") == [] and len(where("strict_yaml.load(saved")) == 1  # one study reader
    assert where("def entry_key(") == ["flatbench/measures/keys.py"]
    assert where("FAMILIES = (") == ["flatbench/rescale.py"]
    assert where('partition("@")') == ["flatbench/measures/keys.py"]
    assert where('split("@"') == []
    assert where("fig.savefig(") == [] and where(".buffer_rgba()") == ["flatbench/figure_png.py"]  # one PNG encoder
    assert where('cache[("hessian_diagonal"') == []  # the cache keys live in measures/shared.py only
    assert where('return ("hessian_diagonal"') == ["flatbench/measures/shared.py"]
    assert where("def config_reference") == []  # the README table generator is a script
    assert where("click") == ["flatbench/cli.py"]
    assert where("Echo = Callable") == ["flatbench/errors.py"]  # how stages print
    assert where("torch.jit.script.*is deprecated") == ["flatbench/errors.py"]  # one warning filter
    assert where("t.target_train_loss") == ["flatbench/training/endpoint.py"]  # "did the run reach its target"
    assert where("def did_you_mean(") == ["flatbench/errors.py"]


FN_CALLS_ALLOWED = {("flatbench/losses.py", "self"), ("flatbench/measures/arguments.py", "loss_fn")}
"""`.fn(...)` calls that are not a measure's: a loss object calling its own function."""


def test_one_place_calls_a_measure():
    """A measure's function (`MeasureSpec.fn`) is called in `measures/evaluate.py` only (issue 43: one
    evaluation core): a second call would compute values without the guard, the time limit or the HVP log,
    and the stage, the audits and the contract could disagree on what a value is."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fn" \
                    and (where, ast.unparse(node.func.value)) not in FN_CALLS_ALLOWED:
                calls.append(f"{where}:{node.lineno} {ast.unparse(node.func)}(...)")
    assert [c for c in calls if not c.startswith("flatbench/measures/evaluate.py:")] == [], calls
    assert len(calls) == 1, calls


def test_no_module_imports_a_private_name_of_another():
    """A name with a leading underscore is its module's own: other modules use the public interface."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flatbench"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import {', '.join(private)}")
    assert not offenders, offenders


MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def test_functions_and_modules_stay_small():
    """Every function of the package is at most 80 lines and every module at most 600 (issue 22's limits:
    a reader sees a function whole, and a module's job from its section headings)."""
    long_functions, long_modules = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long_functions, long_functions
    assert not long_modules, long_modules
