"""The documentation site (docs/, mkdocs.yml) builds strictly, covers every measure, and its examples run.

- The site is built with `mkdocs build --strict` (a broken link, a missing page, a docstring mkdocstrings
  cannot render: a failure). It must fail, not skip, where mkdocs is missing: the test extra installs it.
- Every registered measure has its page, generated from the registry, naming every setting.
- Every ```python block of a page is executed, the page's blocks in order in one fresh process (so a later
  block may use an earlier one's names), in a temporary folder holding the repository's `configs/`,
  `examples/` and `results/` (each committed study linked in: what a page writes stays in the folder); a
  ```yaml block after a `<!-- docs-test: config FILE -->` marker is written to FILE there first and
  validated as a study config.
- Then every `flatbench ...` line of the page's ```bash blocks is run there, in order, as written, and must
  exit 0. A study's command (`run`, `train`) gets the page's `SMALLER` overrides appended (KEY=VALUE, as a
  user would give them): the documented study takes minutes to hours, and the overrides keep its
  commands, options and stages while shrinking the sweep and the epochs. Every line is also parsed by the
  real command line first (an unknown option or a wrong choice fails with its name).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CONFIG_MARK = re.compile(r"<!-- docs-test: config (\S+) -->\n```yaml\n(.*?)^```", re.S | re.M)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def _expand(code: str) -> str:
    """Put the files that pymdownx.snippets includes (`--8<-- "path"`) in place, as the site shows them."""
    return SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), code)


def _blocks(page: Path, language: str) -> list[str]:
    return [_expand(code) for lang, code in FENCE.findall(page.read_text()) if lang == language]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_site_builds_strictly_with_every_section(site):
    for page in ("index.html", "getting-started/quickstart/index.html", "guide/configs/index.html",
                 "measures/index.html", "statistics/index.html", "api/index.html", "results/index.html",
                 "results/natural/index.html", "performance/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    assert "flatbench.measure" in api and "register_measure" in api  # rendered from the docstrings


def test_the_api_page_shows_the_public_api_only(site):
    """docs/api.md renders `flatbench.__all__` under the names users import, and no internal name: no
    module path of the package's inside, no private name, nothing outside `__all__`."""
    import flatbench

    text = re.sub(r"<[^>]+>", " ", (site / "api" / "index.html").read_text())
    article = text[text.index("API reference"):]
    for name in flatbench.__all__:
        assert f"flatbench.{name}" in article, name
    internal = ["flatbench.api", "flatbench.measures", "flatbench.rescale", "flatbench.study", "flatbench.losses",
                "in_place", "isolation.", "arguments.", "copy_model", "measure_records", "measure_model",
                "report_study", "DEFAULT_TIMEOUT_S", "TRANSFORMS"]
    assert not [word for word in internal if word in article], [word for word in internal if word in article]
    private = re.findall(r"(?<![\w_])_[A-Za-z]\w*", article)
    assert not private, private


def test_the_measure_reference_covers_every_measure_with_every_setting(site):
    from flatbench.measures.reference_page import measure_page
    from flatbench.measures.registry import all_measures

    table = (site / "measures" / "index.html").read_text()
    for name, spec in all_measures().items():
        page = measure_page(name)
        for key in spec.defaults:
            assert f"`{key}`" in page, (name, key)
        assert (site / "measures" / name / "index.html").is_file(), name
        assert f'href="{name}/"' in table, name


def test_a_plugin_measure_gets_its_reference_page_the_same_way():
    from flatbench.measures.registry import load_plugins
    from flatbench.measures.reference_page import measure_page

    load_plugins([str(ROOT / "examples" / "weighted_trace.py")])
    page = measure_page("weighted_trace")
    assert page.startswith("# `weighted_trace`")
    assert "layer: " in page and "Registered by the plugin" in page


def test_every_page_is_in_the_tests_and_the_generated_tables_are_marked():
    assert "<!-- generated: measure-table -->" in (DOCS / "measures" / "index.md").read_text()
    assert "<!-- generated: config-reference -->" in (DOCS / "guide" / "configs.md").read_text()
    assert len([p for p in PAGES if _blocks(p, "python")]) >= 4


def _command_lines(page: Path) -> list[str]:
    lines = []
    for block in _blocks(page, "bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("flatbench "):
                lines.append(line)
    return lines


SMALLER = {"getting-started/own-study.md": [
    "train.epochs=2", "train.target_train_loss=null", "data.n_train=200", "model.widths=[[16]]",
    "measure.n_examples=100", "measure.measures=[frobenius_norm,path_norm,hessian_trace]",
    "report.min_train_acc=0"]}  # 2 epochs train no run to the 90% the report asks by default
"""Overrides appended to a page's `flatbench run` / `flatbench train` lines when the test runs them."""


def _sandbox(tmp_path: Path) -> Path:
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "results").mkdir()
    for study in (ROOT / "results").iterdir():
        (tmp_path / "results" / study.name).symlink_to(study)
    return tmp_path


def _run_command_lines(page: Path, where: Path) -> None:
    """Run the page's `flatbench ...` lines in `where`, in order (a study's command made smaller: `SMALLER`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    for line in _command_lines(page):
        args = shlex.split(line)[1:]
        if args[0] in ("run", "train"):
            args += SMALLER.get(str(page.relative_to(DOCS)), [])
        result = subprocess.run([sys.executable, "-m", "flatbench", *args], cwd=where, capture_output=True,
                                text=True, env=env, timeout=600)
        assert result.returncode == 0, f"{page.name}: {line!r} exited {result.returncode}:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "python") or CONFIG_MARK.search(p.read_text())
                                  or _command_lines(p)], ids=lambda p: str(p.relative_to(DOCS)))
def test_the_examples_of_a_page_run(page, tmp_path):
    from flatbench.config import load_study

    where = _sandbox(tmp_path)
    for name, text in CONFIG_MARK.findall(page.read_text()):
        (where / name).write_text(text)
        assert load_study(where / name).runs, name
    code = "\n\n".join(_blocks(page, "python"))
    if code:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
        result = subprocess.run([sys.executable, "-c", code], cwd=where, capture_output=True, text=True, env=env,
                                timeout=300)
        assert result.returncode == 0, f"{page}:\n{result.stderr[-3000:]}"
    _run_command_lines(page, where)


@pytest.mark.parametrize("page", [p for p in PAGES if _command_lines(p)], ids=lambda p: str(p.relative_to(DOCS)))
def test_the_command_lines_of_a_page_parse(page):
    """Each `flatbench ...` line names a real command with real options and valid choices (parsed by click,
    not run)."""
    import click

    from flatbench.cli import cli

    for line in _command_lines(page):
        name, *rest = shlex.split(line)[1:]
        parent = click.Context(cli, info_name="flatbench")
        command = cli.get_command(parent, name)
        assert command is not None, f"{page.name}: {line!r}: no command {name!r}"
        try:
            command.make_context(name, rest, parent=parent)
        except click.UsageError as error:  # pragma: no cover - the failure message
            pytest.fail(f"{page.name}: {line!r}: {error}")


def test_the_results_pages_tables_are_the_committed_numbers(tmp_path):
    """Every marked table of docs/results/ is what `scripts/results_tables.py --update` writes from the
    committed studies today: refilling a copy changes nothing."""
    from project_scripts import load_script

    module = load_script("results_tables")
    pages = sorted((DOCS / "results").glob("*.md"))
    assert sum(p.read_text().count("<!-- table: ") for p in pages) >= 20
    for page in pages:
        copy = tmp_path / page.name
        copy.write_text(page.read_text())
        module.update(copy)
        assert copy.read_text() == page.read_text(), f"{page.name}: run scripts/results_tables.py --update"
