"""A self-contained HTML page: inline CSS, no script, no external resource — opens offline.

Fleet summary (verdicts, vLLM versions, backends, modified files, unreachable hosts), a host table,
and per-host detail (<details>): install, MLA entries, findings with evidence, steps, errors.
Everything from the report is escaped (Jinja2 autoescape).
"""
from __future__ import annotations

from pathlib import Path

import jinja2

from mla_doctor.reports import host_rows

TEMPLATE = Path(__file__).with_name("fleet.html.j2")

_ENV = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined, trim_blocks=False)


def render(doc: dict) -> str:
    fl = doc.get("fleet") or {}
    s = fl.get("summary") or {"verdicts": {}, "vllm_versions": {}, "backends": {}, "modified_files": {},
                              "unreachable": []}
    return _ENV.from_string(TEMPLATE.read_text(encoding="utf-8")).render(doc=doc, fl=fl, s=s, rows=host_rows(doc))
