"""YAML as flatbench reads it: safe, and strict about duplicate keys.

PyYAML keeps the last of two equal keys in a mapping without a word, so a second `train:` section in a
config (or a second `report:` in a saved study.yaml) silently replaces the first and a study trains with
values nobody meant. Every YAML flatbench reads goes through `load`, which refuses a duplicate key as a
`yaml.YAMLError` naming the key and the line of both occurrences; `describe` turns any YAML error into
the few words of a one-line message.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (a `<<` merge may still override) and a
    document that expands to more than MAX_NODES nodes."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None and _expanded_size(node) > MAX_NODES:
            raise yaml.YAMLError(f"the document expands to more than {MAX_NODES} values through its aliases "
                                 "(anchors of aliases of anchors: a \"billion laughs\"); write the values out")
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base constructor says so
                if first is not None:
                    raise ConstructorError("while constructing a mapping", node.start_mark,
                                           f"duplicate key {key!r} (also at line {first + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


MAX_NODES = 100_000
"""The most nodes a document may expand to, its aliases expanded: a "billion laughs" document (anchors of
aliases of anchors) is a few lines that expand exponentially, and every reader of the result (flattening a
config, hashing it, printing it) would walk the whole expansion."""


def _expanded_size(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded (each node counted once per path to it), computed on
    the shared graph in linear time; stops counting past MAX_NODES. A recursive alias is refused."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        kids = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        if children_done:
            open_nodes.discard(id(node))
            size[id(node)] = min(MAX_NODES + 1, 1 + sum(size[id(k)] for k in kids))
            continue
        if id(node) in open_nodes:
            raise yaml.YAMLError(f"a recursive alias at line {node.start_mark.line + 1}")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    return size[id(root)]


EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""`1e-3`, `5E4`: floats in YAML 1.2 and to every user, strings in PyYAML's YAML 1.1 (which wants a dot:
`1.0e-3`), so that a setting given as 1e-3 was refused as "expected a number, got '1e-3'"."""
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789"))


def load(text: str) -> Any:
    """The YAML document `text`, read safely; a duplicate key raises a `yaml.YAMLError`."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader


def describe(exc: yaml.YAMLError) -> str:
    """' at line L, column C: problem' (or ': problem' where the line is not known) for a YAML error, to
    follow the file's name in a one-line message."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["unreadable"])[0]
    return f"{where}: {problem}"
