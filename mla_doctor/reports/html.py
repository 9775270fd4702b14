"""A self-contained HTML page: inline CSS, no script, no external resource — opens offline.

Fleet summary (verdicts, vLLM versions, backends, modified files, unreachable hosts), a host table,
and per-host detail (<details>): install, MLA entries, findings with evidence, steps, errors.
Everything from the report is escaped (Jinja2 autoescape), and every value is made inert first
(`terminal.xml`: controls and ESC shown escaped), so the page is safe to `cat` to a terminal too.
"""
from __future__ import annotations

from pathlib import Path

import jinja2
import markupsafe

from mla_doctor import terminal
from mla_doctor.reports import host_rows

TEMPLATE = Path(__file__).with_name("fleet.html.j2")

def _inert(value):
    """Every `{{ … }}` value from the report (never the template's own markup) without raw controls."""
    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return terminal.xml(value)
    return value


_ENV = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined, trim_blocks=False,
                          finalize=_inert)


def render(doc: dict) -> str:
    fl = doc.get("fleet") or {}
    s = fl.get("summary") or {"verdicts": {}, "vllm_versions": {}, "backends": {}, "modified_files": {},
                              "unreachable": []}
    return _ENV.from_string(TEMPLATE.read_text(encoding="utf-8")).render(doc=doc, fl=fl, s=s, rows=host_rows(doc))
