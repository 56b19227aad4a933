"""The report as documents: one list of blocks rendered to Markdown and to self-contained HTML.

    from pipeline.report.document import to_html, to_markdown
    md = to_markdown(title, blocks)
    page = to_html(title, blocks, figures, decision)   # figures: name -> PNG bytes, embedded as base64

A block is one of
    ("h2" | "h3" | "p" | "pre", text)    pre: JSON, folded in the page
    ("code", text)                        plain preformatted text, shown as it is
    ("table", headers, rows, classes)     rows of str; classes per cell (CSS: pass, fail, ...) or None
    ("img", name, caption[, "wide"])      name is a key of `figures` (and a file beside report.md)
Both renderers read the same blocks, so the Markdown and the page say the same thing.
"""
from __future__ import annotations

import base64
import html
import re

Block = tuple


def to_markdown(title: str, blocks: list[Block]) -> str:
    out = [f"# {title}", ""]
    for b in blocks:
        if b[0] in ("h2", "h3"):
            out += [("## " if b[0] == "h2" else "### ") + b[1], ""]
        elif b[0] == "p":
            out += [b[1], ""]
        elif b[0] == "pre":
            out += ["```json", b[1], "```", ""]
        elif b[0] == "code":
            out += ["```text", b[1], "```", ""]
        elif b[0] == "img":
            out += [f"![{b[2]}]({b[1]})", ""]
        elif b[0] == "table":
            _, headers, rows, _ = b
            out += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows] + [""]
    return "\n".join(out)


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}
.pass,.go{background:#c8e6c9}.fail,.no-go{background:#ffcdd2}.inconclusive{background:#ffe0b2}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}
pre{background:#f7f7f7;padding:.6em;font-size:12px;max-height:30em;overflow:auto}
pre.summary{white-space:pre-wrap;overflow-wrap:anywhere}code{background:#f3f3f3;padding:0 .2em}
.banner{font-size:1.6em;padding:.3em .6em;display:inline-block}
figure{margin:0 1em 1em 0;display:inline-block;vertical-align:top;max-width:48%}
figure.wide{display:block;max-width:900px}figcaption{font-size:12px;color:#555}"""


def _inline(text: str) -> str:
    """Escaped text with the Markdown's `code` spans and **bold** rendered."""
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


def to_html(title: str, blocks: list[Block], figures: dict[str, bytes], decision: str) -> str:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{e(title)}</title>",
           f"<style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
           f"<div class='banner {e(decision)}'>release decision: <b>{e(decision.upper())}</b></div>"]
    for b in blocks:
        if b[0] in ("h2", "h3", "p"):
            out.append(f"<{b[0]}>{_inline(b[1])}</{b[0]}>")
        elif b[0] == "pre":
            out.append(f"<details><summary>show</summary><pre>{e(b[1])}</pre></details>")
        elif b[0] == "code":
            out.append(f"<pre class='summary'>{e(b[1])}</pre>")
        elif b[0] == "img":
            data = base64.b64encode(figures[b[1]]).decode()
            wide = " class='wide'" if len(b) > 3 and b[3] == "wide" else ""
            out.append(f"<figure{wide}><img alt='{e(b[2])}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{e(b[2])}</figcaption></figure>")
        elif b[0] == "table":
            _, headers, rows, classes = b
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>")
            for i, r in enumerate(rows):
                cls = classes[i] if classes else [None] * len(r)
                out.append("<tr>" + "".join((f"<td class='{e(c)}'>" if c else "<td>") + _inline(v) + "</td>"
                                     for v, c in zip(r, cls)) + "</tr>")
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)
