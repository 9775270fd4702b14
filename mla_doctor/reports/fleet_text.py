"""Plain text for a terminal: one line per host, then what failed and why."""
from __future__ import annotations

from mla_doctor import terminal
from mla_doctor.reports import host_rows


def render(doc: dict) -> str:
    # every cell is host-provided or copied from a saved report: no control character reaches the terminal
    rows = [{k: (terminal.line(v) if isinstance(v, str) else [terminal.line(x) for x in v] if isinstance(v, list)
                 else v) for k, v in r.items()} for r in host_rows(doc)]
    cols = [("host", "HOST"), ("verdict", "VERDICT"), ("version", "VLLM"), ("backend", "BACKEND"),
            ("prefill", "PREFILL ENTRY"), ("decode", "DECODE ENTRY")]
    widths = {k: max([len(t)] + [len(str(r[k])) for r in rows]) for k, t in cols}
    out = ["  ".join(t.ljust(widths[k]) for k, t in cols).rstrip()]
    for r in rows:
        out.append("  ".join(str(r[k]).ljust(widths[k]) for k, _ in cols).rstrip())
    problems = [r for r in rows if r["exit"]]
    if problems:
        out.append("")
        for r in problems:
            why = r["error"] or "; ".join(r["fails"])
            out.append(f"{r['host']}: {str(r['verdict'] or h_status(r)).upper()}: {why}")
            if r["modified"]:
                out.append(f"    modified: {', '.join(r['modified'])}")
    fl = doc.get("fleet") or {}
    s = fl.get("summary") or {}
    v = s.get("verdicts") or {}
    out.append("")
    out.append(f"{s.get('hosts', len(rows))} hosts: " + ", ".join(f"{n} {k}" for k, n in v.items() if n)
               + f" -> exit {doc.get('exit_status')} ({doc.get('exit_name')}), {doc.get('duration_s', 0):.1f}s")
    if fl.get("retry_file"):
        out.append(f"re-run the {len(fl.get('retry') or [])} that did not pass: "
                   f"--limit @{terminal.line(fl['retry_file'])}")
    return terminal.text("\n".join(out)) + "\n"


def h_status(row: dict) -> str:
    """A saved report's host without a verdict (an older or hand-made report: `report render` reads any)"""
    return "error" if row.get("error") else "?"
