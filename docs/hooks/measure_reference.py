"""MkDocs hook: the measure reference, one page per registered measure, generated from the registry at build
time (never written by hand, so it cannot drift from the code; a plugin's measure gets its page the same way
when its plugin is loaded, e.g. with FLATBENCH_DOCS_PLUGINS=path/to/plugin.py)."""

from __future__ import annotations

import os

from mkdocs.structure.files import File


def _names() -> list[str]:
    from flatbench.measures.registry import all_measures, load_plugins

    plugins = [p for p in os.environ.get("FLATBENCH_DOCS_PLUGINS", "").split(os.pathsep) if p]
    if plugins:
        load_plugins(plugins)
    return sorted(all_measures())


def on_config(config):
    """Put every measure's page under "Measure reference" in the navigation."""
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Measure reference" in entry:
            entry["Measure reference"] = ["measures/index.md"] + [
                {name: f"measures/{name}.md"} for name in _names()]
    return config


def on_files(files, config):
    """Add the generated pages to the site."""
    from flatbench.measures.reference_page import measure_page

    for name in _names():
        files.append(File.generated(config, f"measures/{name}.md", content=measure_page(name)))
    return files


def _tables_script():
    """scripts/readme_tables.py (a script, not part of the package: tests/test_structure.py)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "readme_tables.py"
    spec = importlib.util.spec_from_file_location("readme_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown, page, config, files):
    """Fill in the generated tables: the config reference and the measure list."""
    if "<!-- generated: " not in markdown:
        return markdown
    tables = _tables_script()
    return (markdown.replace("<!-- generated: config-reference -->", tables.config_reference())
            .replace("<!-- generated: measure-table -->", tables.measures_table(links=True)))
