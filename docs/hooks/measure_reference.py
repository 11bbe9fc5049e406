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
