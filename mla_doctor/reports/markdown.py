"""Markdown (a CI summary, a ticket comment)."""
from __future__ import annotations

from mla_doctor import terminal
from mla_doctor.reports import host_rows


_MD_SPECIAL = "\\`*_[]<>|#!~"
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def _cell(x) -> str:
    """A host-provided string as inert Markdown text: no raw HTML, no emphasis/links/code, one line, no `|` that
    would end a table cell, no control character (shown escaped)."""
    out = []
    for ch in terminal.line(str(x).replace("\r\n", " ").replace("\n", " ")):
        if ch in _HTML:
            out.append(_HTML[ch])
        elif ch in _MD_SPECIAL:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def _code(x) -> str:
    """Inline code for a host-provided string (a file path): backticks cannot end it early."""
    text = terminal.line(str(x).replace("\n", " "))
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def render(doc: dict) -> str:
    fl = doc.get("fleet") or {}
    s = fl.get("summary") or {}
    rows = host_rows(doc)
    out = [f"# mla-doctor fleet audit: {_cell(str(doc.get('overall', '?')).upper())}", ""]
    out.append(f"Playbook {_code(fl.get('playbook'))}, inventory {_code(fl.get('inventory'))}, {len(rows)} hosts, "
               f"exit {doc.get('exit_status')} ({doc.get('exit_name')}), started {doc.get('started')}.")
    out.append("")
    out.append("| verdict | hosts |")
    out.append("|---|---|")
    for k, n in (s.get("verdicts") or {}).items():
        out.append(f"| {_cell(k)} | {_cell(n)} |")
    out += ["", "## vLLM versions", "", "| version | hosts |", "|---|---|"]
    out += [f"| {_cell(k)} | {_cell(n)} |" for k, n in (s.get("vllm_versions") or {}).items()]
    out += ["", "## Backends (selected decode backend, from the server log)", "", "| backend | hosts |", "|---|---|"]
    out += [f"| {_cell(k)} | {_cell(n)} |" for k, n in (s.get("backends") or {}).items()]
    if s.get("modified_files"):
        out += ["", "## Modified vLLM files", ""]
        out += [f"- **{_cell(h)}**: " + ", ".join(_code(f) for f in files) for h, files in s["modified_files"].items()]
    if s.get("unreachable"):
        out += ["", "## Unreachable", ""] + [f"- {_cell(h)}" for h in s["unreachable"]]
    out += ["", "## Hosts", "",
            "| host | verdict | vLLM | backend | prefill entry | decode entry | model sparse | problem (fail, warn) "
            "| path verdict (live, else static) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join(_cell(x) for x in (r["host"], r["verdict"], r["version"], r["backend"],
                                                         r["prefill"], r["decode"], r["sparse"], r["problem"],
                                                         r["path_verdict"])) + " |")
    if fl.get("retry"):
        out += ["", "Re-run the hosts that did not pass: " + ", ".join(_cell(h) for h in fl["retry"])]
    return terminal.text("\n".join(out)) + "\n"  # the last net: no control character from a saved report
