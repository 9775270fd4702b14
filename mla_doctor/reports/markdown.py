"""Markdown (a CI summary, a ticket comment)."""
from __future__ import annotations

from mla_doctor.reports import host_rows


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def render(doc: dict) -> str:
    fl = doc.get("fleet") or {}
    s = fl.get("summary") or {}
    rows = host_rows(doc)
    out = [f"# mla-doctor fleet audit: {doc.get('overall', '?').upper()}", ""]
    out.append(f"Playbook `{fl.get('playbook')}`, inventory `{fl.get('inventory')}`, {len(rows)} hosts, "
               f"exit {doc.get('exit_status')} ({doc.get('exit_name')}), started {doc.get('started')}.")
    out.append("")
    out.append("| verdict | hosts |")
    out.append("|---|---|")
    for k, n in (s.get("verdicts") or {}).items():
        out.append(f"| {k} | {n} |")
    out += ["", "## vLLM versions", "", "| version | hosts |", "|---|---|"]
    out += [f"| {_cell(k)} | {n} |" for k, n in (s.get("vllm_versions") or {}).items()]
    out += ["", "## Backends (selected decode backend, from the server log)", "", "| backend | hosts |", "|---|---|"]
    out += [f"| {_cell(k)} | {n} |" for k, n in (s.get("backends") or {}).items()]
    if s.get("modified_files"):
        out += ["", "## Modified vLLM files", ""]
        out += [f"- **{h}**: " + ", ".join(f"`{f}`" for f in files) for h, files in s["modified_files"].items()]
    if s.get("unreachable"):
        out += ["", "## Unreachable", ""] + [f"- {h}" for h in s["unreachable"]]
    out += ["", "## Hosts", "", "| host | verdict | vLLM | backend | prefill entry | decode entry | sparse | problem |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        why = r["error"] or ", ".join(r["fails"])
        out.append("| " + " | ".join(_cell(x) for x in (r["host"], r["verdict"], r["version"], r["backend"],
                                                         r["prefill"], r["decode"], r["sparse"], why or "")) + " |")
    if fl.get("retry"):
        out += ["", "Re-run the hosts that did not pass: " + ", ".join(fl["retry"])]
    return "\n".join(out) + "\n"
