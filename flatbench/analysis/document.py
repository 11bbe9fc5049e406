"""One report document, rendered twice: `report.md` (images by relative path, text escaped so that it
reads the same as plain text and rendered) and a self-contained `report.html` (images embedded as data
URIs, styles, script and data inline: nothing is fetched, so the page can be mailed, archived or opened
on an offline cluster node). Without scripts the HTML shows every table and image; the script adds
sorting, filtering and the scatter plots' hover (`html_assets`).

Inline markup in text, the same in both outputs: `code` (measure names, whose underscores Markdown
would read as emphasis), **bold**, and [links](relative/path). Everything else is plain text: escaped
for Markdown (`_`, `*`, `$`, … are written as `\\_`, …) and for HTML.
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass, field
from typing import Any

from flatbench.analysis.html_assets import CSS, SCRIPT

_INLINE = re.compile(r"`([^`]+)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")
_MD_SPECIAL = re.compile(r"([\\`*_<~$])")
"""What Markdown (GitHub's included: ~strike~, $math$) could read as markup in plain text. Brackets are
left alone: without a following "(" they are not a link, and "τ [0.78, 0.93]" stays readable."""
_MD_CELL = re.compile(r"([\\`*_<~$|])")


@dataclass
class Heading:
    level: int
    text: str
    anchor: str = ""


@dataclass
class Paragraph:
    text: str
    css: str = ""
    """A class for the HTML paragraph (e.g. "design": the verdict block's first line)."""


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool] | None = None
    """Right-align these columns (numbers line up by their digits)."""
    table_id: str = ""
    sortable: bool = False
    filters: list[str] = field(default_factory=list)
    """Row attributes the page offers filters for (`data-<name>` on each row, values space-separated)."""
    row_attrs: list[dict[str, str]] | None = None
    compact: bool = False
    ascending: list[bool] | None = None
    """Columns whose first sort press puts the smallest value first (p-values, sign errors, ranks)."""
    foot: list[list[str]] = field(default_factory=list)
    """Rows kept below the sorted ones (the reference rows: floor and ceiling)."""
    colors: dict[tuple[int, int], str] = field(default_factory=dict)
    """(row, column) → a cell's background colour (rows counted over `rows` then `foot`)."""
    nowrap: frozenset[int] = frozenset()
    """Columns whose cells never wrap (short phrases such as the verdict's "node: moves 0.088")."""


@dataclass
class CodeBlock:
    text: str
    language: str = ""


@dataclass
class Image:
    relpath: str
    """Path relative to the report, for the markdown file."""
    png: bytes
    """The image itself, embedded in the HTML."""
    caption: str = ""
    width: int = 0
    height: int = 0
    hover: dict[str, Any] | None = None
    """Points for the page's hover: {"points": [[x, y, run, panel, value], ...], "panels": [key, ...]}."""
    css: str = ""
    """A class for the figure ("full": printed up to a page tall instead of the print sheet's figure height;
    "facet": one of a set of figures the page shows one at a time, chosen by `key` in a select)."""
    key: str = ""


@dataclass
class Details:
    """Blocks a reader opens when they want them (`<details>` in the HTML: collapsed, present without
    scripts); the markdown shows them under a bold line, since text has no folding."""

    summary: str
    blocks: list[Heading | Paragraph | Bullets | Table | CodeBlock | Image]


Block = Heading | Paragraph | Bullets | Table | CodeBlock | Image | Details


def plain(text: str) -> str:
    """The text without inline markup (for alt texts and titles): `a_b` → a_b, [x](y) → x."""
    return _INLINE.sub(lambda m: m.group(1) or m.group(2) or m.group(3), text)


def md_text(text: str, cell: bool = False) -> str:
    """Markdown for a text with inline markup: the markup kept, every other special character escaped
    (in a table `cell`, the column separator | too)."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(_md_escape(text[pos:m.start()], cell))
        if m.group(1) is not None:
            out.append(f"`{m.group(1)}`")
        elif m.group(2) is not None:
            out.append(f"**{_md_escape(m.group(2), cell)}**")
        else:
            out.append(f"[{_md_escape(m.group(3), cell)}]({m.group(4)})")
        pos = m.end()
    out.append(_md_escape(text[pos:], cell))
    return "".join(out).replace("\n", " ")


def _md_escape(text: str, cell: bool = False) -> str:
    """Plain text for Markdown: every character Markdown could read as markup, backslash-escaped."""
    return (_MD_CELL if cell else _MD_SPECIAL).sub(r"\\\1", text)


def inline_html(text: str) -> str:
    """HTML for a text with inline markup."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()], quote=False))
        if m.group(1) is not None:  # a long key wraps before "@loss", ":variant" or after "_", never mid-word
            code = html.escape(m.group(1), quote=False).replace("@", "<wbr>@").replace(":", "<wbr>:") \
                .replace("_", "_<wbr>").replace(".", ".<wbr>")
            out.append(f"<code>{code}</code>")
        elif m.group(2) is not None:
            out.append(f"<strong>{html.escape(m.group(2), quote=False)}</strong>")
        else:
            out.append(f'<a href="{html.escape(m.group(4))}">{html.escape(m.group(3), quote=False)}</a>')
        pos = m.end()
    out.append(html.escape(text[pos:], quote=False))
    return "".join(out)


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    """Inline data for the page's script (e.g. the runs the hover describes)."""

    def add(self, block: Block) -> None:
        self.blocks.append(block)

    def to_markdown(self) -> str:
        out = [f"# {md_text(self.title)}", ""]
        for block in self.blocks:
            out.extend(_md_block(block))
            out.append("")
        return "\n".join(out).rstrip() + "\n"

    def to_html(self) -> str:
        toc = [b for b in self.blocks if isinstance(b, Heading) and b.level == 2 and b.anchor]
        body = []
        if toc:
            links = " · ".join(f'<a href="#{html.escape(h.anchor)}">{inline_html(h.text)}</a>' for h in toc)
            body.append(f'<nav class="toc">{links}</nav>')
        figures = 0
        for block in self.blocks:
            if isinstance(block, Image) and block.hover:
                figures += 1
                body.append(_html_image(block, f"fbfig{figures}"))
            else:
                body.append(_html_block(block))
        data = _json_script("fb-data", self.data) if self.data else ""
        return (
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(plain(self.title))}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{inline_html(self.title)}</h1>\n" + "\n".join(body) + f"\n{data}<script>{SCRIPT}</script>\n"
            "</body>\n</html>\n"
        )


def _json_script(element_id: str, payload: Any) -> str:
    text = json.dumps(payload, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>\n'


def _md_block(block: Block) -> list[str]:
    if isinstance(block, Heading):
        return ["#" * block.level + " " + md_text(block.text)]
    if isinstance(block, Paragraph):
        return [md_text(block.text)]
    if isinstance(block, Bullets):
        return [f"- {md_text(item)}" for item in block.items]
    if isinstance(block, Table):
        numeric = block.numeric or [False] * len(block.headers)
        lines = ["| " + " | ".join(md_text(h, cell=True) for h in block.headers) + " |",
                 "|" + "|".join("---:" if num else ":---" for num in numeric) + "|"]
        lines += ["| " + " | ".join(md_text(c, cell=True) for c in row) + " |" for row in [*block.rows, *block.foot]]
        return lines
    if isinstance(block, Details):
        lines = [f"**{md_text(block.summary)}**", ""]
        for inner in block.blocks:
            lines += [*_md_block(inner), ""]
        return lines[:-1]
    if isinstance(block, CodeBlock):
        fence = "````" if "```" in block.text else "```"
        return [fence + block.language, block.text.rstrip("\n"), fence]
    if isinstance(block, Image):
        alt = _md_escape(plain(block.caption or block.relpath).replace("\n", " ").replace("[", "(").replace("]", ")"))
        lines = [f"![{alt}]({block.relpath})"]
        if block.caption:
            lines += ["", md_text(block.caption)]
        return lines
    raise TypeError(f"unknown block {type(block).__name__}")


def _html_cell(text: str, numeric: bool, color: str, nowrap: bool = False) -> str:
    style = f' style="background:{color};color:{_ink(color)}"' if color else ""
    classes = " ".join(c for c in ("num" if numeric else "", "nowrap" if nowrap else "") if c)
    css = f' class="{classes}"' if classes else ""
    return f"<td{css}{style}>{inline_html(text)}</td>"


def _ink(color: str) -> str:
    """Black or white text on a "#rrggbb" background."""
    try:
        r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    except ValueError:
        return "#111"
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "#111"


def _html_table(block: Table) -> str:
    numeric = block.numeric or [False] * len(block.headers)
    asc = block.ascending or [False] * len(block.headers)
    order = ' data-order="asc"'
    head = "".join(f'<th{order if up else ""}>{inline_html(h)}</th>' for h, up in zip(block.headers, asc))
    rows, foot = [], []
    for i, row in enumerate([*block.rows, *block.foot]):
        attrs = block.row_attrs[i] if block.row_attrs and i < len(block.row_attrs) else {}
        attr_text = "".join(f' data-{k}="{html.escape(v)}"' for k, v in attrs.items())
        cells = "".join(_html_cell(c, num, block.colors.get((i, j), ""), j in block.nowrap)
                        for j, (c, num) in enumerate(zip(row, numeric)))
        (rows if i < len(block.rows) else foot).append(f"<tr{attr_text}>{cells}</tr>")
    classes = " ".join(c for c in ("sortable" if block.sortable else "", "compact" if block.compact else "") if c)
    attrs = (f' id="{html.escape(block.table_id)}"' if block.table_id else "") + \
        (f' class="{classes}"' if classes else "") + \
        (f' data-filters="{html.escape(" ".join(block.filters))}"' if block.filters else "")
    return (f'<div class="tablewrap"><table{attrs}><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody>' + (f'<tfoot>{"".join(foot)}</tfoot>' if foot else "") +
            "</table></div>")


def _img_tag(block: Image) -> str:
    data = base64.b64encode(block.png).decode("ascii")
    alt = html.escape(plain(block.caption or block.relpath))
    size = f' width="{block.width}" height="{block.height}"' if block.width and block.height else ""
    return f'<img src="data:image/png;base64,{data}" alt="{alt}"{size}>'


def _html_image(block: Image, fig_id: str) -> str:
    caption = f"<figcaption>{inline_html(block.caption)}</figcaption>" if block.caption else ""
    css = " ".join(c for c in ("hover", block.css) if c)
    key = f' data-facet="{html.escape(block.key)}"' if block.key else ""
    return (f'<figure class="{css}" id="{fig_id}"{key}><div class="hoverbox">{_img_tag(block)}</div>{caption}'
            f"</figure>\n" + _json_script(f"{fig_id}-points", block.hover))


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        anchor = f' id="{html.escape(block.anchor)}"' if block.anchor else ""
        return f"<h{block.level}{anchor}>{inline_html(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        css = f' class="{html.escape(block.css)}"' if block.css else ""
        return f"<p{css}>{inline_html(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{inline_html(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Table):
        return _html_table(block)
    if isinstance(block, Details):
        inner = "\n".join(_html_block(b) for b in block.blocks)
        return f"<details><summary>{inline_html(block.summary)}</summary>\n{inner}\n</details>"
    if isinstance(block, CodeBlock):
        return f"<pre><code>{html.escape(block.text)}</code></pre>"
    if isinstance(block, Image):
        caption = f"<figcaption>{inline_html(block.caption)}</figcaption>" if block.caption else ""
        css = f' class="{html.escape(block.css)}"' if block.css else ""
        return f"<figure{css}>{_img_tag(block)}{caption}</figure>"
    raise TypeError(f"unknown block {type(block).__name__}")
