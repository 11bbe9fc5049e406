"""One report document, rendered twice: `report.md` (images by relative path) and a self-contained
`report.html` (images embedded as base64 data URIs, styles inline, no script, no external reference),
so the HTML can be mailed, archived or opened on an offline cluster node and still show everything.

Text is plain; a `backticked` span becomes code in both outputs (measure names contain underscores that
Markdown would otherwise read as emphasis).
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field

_CODE_SPAN = re.compile(r"`([^`]+)`")


@dataclass
class Heading:
    level: int
    text: str
    anchor: str = ""


@dataclass
class Paragraph:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool] | None = None
    """Right-align these columns (numbers line up by their digits)."""


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


Block = Heading | Paragraph | Bullets | Table | CodeBlock | Image


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def add(self, block: Block) -> None:
        self.blocks.append(block)

    # ------------------------------------------------------------------ markdown
    def to_markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for block in self.blocks:
            out.extend(_md_block(block))
            out.append("")
        return "\n".join(out).rstrip() + "\n"

    # ---------------------------------------------------------------------- html
    def to_html(self) -> str:
        toc = [b for b in self.blocks if isinstance(b, Heading) and b.level == 2 and b.anchor]
        body = []
        if toc:
            links = " · ".join(f'<a href="#{html.escape(h.anchor)}">{_inline_html(h.text)}</a>' for h in toc)
            body.append(f'<nav class="toc">{links}</nav>')
        body.extend(_html_block(b) for b in self.blocks)
        return (
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(self.title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<h1>{_inline_html(self.title)}</h1>\n" + "\n".join(body) + "\n</body>\n</html>\n"
        )


def _md_escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_block(block: Block) -> list[str]:
    if isinstance(block, Heading):
        return ["#" * block.level + " " + block.text]
    if isinstance(block, Paragraph):
        return [block.text]
    if isinstance(block, Bullets):
        return [f"- {item}" for item in block.items]
    if isinstance(block, Table):
        numeric = block.numeric or [False] * len(block.headers)
        lines = ["| " + " | ".join(_md_escape_cell(h) for h in block.headers) + " |",
                 "|" + "|".join("---:" if num else ":---" for num in numeric) + "|"]
        lines += ["| " + " | ".join(_md_escape_cell(c) for c in row) + " |" for row in block.rows]
        return lines
    if isinstance(block, CodeBlock):
        fence = "````" if "```" in block.text else "```"
        return [fence + block.language, block.text.rstrip("\n"), fence]
    if isinstance(block, Image):
        lines = [f"![{block.caption or block.relpath}]({block.relpath})"]
        if block.caption:
            lines += ["", f"*{block.caption}*"]
        return lines
    raise TypeError(f"unknown block {type(block).__name__}")


def _inline_html(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        anchor = f' id="{html.escape(block.anchor)}"' if block.anchor else ""
        return f"<h{block.level}{anchor}>{_inline_html(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{_inline_html(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Table):
        numeric = block.numeric or [False] * len(block.headers)
        head = "".join(f"<th>{_inline_html(h)}</th>" for h in block.headers)
        rows = []
        for row in block.rows:
            cells = "".join(f'<td class="num">{_inline_html(c)}</td>' if num else f"<td>{_inline_html(c)}</td>"
                            for c, num in zip(row, numeric))
            rows.append(f"<tr>{cells}</tr>")
        return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'
    if isinstance(block, CodeBlock):
        return f"<pre><code>{html.escape(block.text)}</code></pre>"
    if isinstance(block, Image):
        data = base64.b64encode(block.png).decode("ascii")
        alt = html.escape(block.caption or block.relpath)
        caption = f"<figcaption>{_inline_html(block.caption)}</figcaption>" if block.caption else ""
        return f'<figure><img src="data:image/png;base64,{data}" alt="{alt}">{caption}</figure>'
    raise TypeError(f"unknown block {type(block).__name__}")


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#111;line-height:1.45}
h1{font-size:1.6em}h2{font-size:1.3em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.8em}
h3{font-size:1.08em;margin-top:1.4em}
table{border-collapse:collapse;font-size:.86em;margin:.6em 0}
th,td{border:1px solid #bbb;padding:.25em .55em;text-align:left;vertical-align:top}
th{background:#eee}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:nth-child(even){background:#f7f7f7}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.92em}
pre{background:#f5f5f5;border:1px solid #ddd;padding:.7em;overflow-x:auto;font-size:.85em}
figure{margin:1em 0}img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85em;color:#444}.scroll{overflow-x:auto}
nav.toc{font-size:.9em;margin-bottom:1em}
@media print{body{max-width:none}a{color:inherit;text-decoration:none}}
"""
