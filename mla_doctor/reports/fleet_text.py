"""Plain text for a terminal: one line per host, then what failed and why."""
from __future__ import annotations

from mla_doctor import terminal
from mla_doctor.reports import host_rows


def _table(rows: list[dict], cols: list[tuple[str, str]], width: int) -> list[str]:
    """The table fitted to `width` (0: not fitted): a cell too wide for its column wraps inside it, at spaces or
    after a `/`, never cut; the host and verdict columns never wrap (a host `gpu-a` is never `gpu-` / `a`)."""
    widths = {k: max([len(t)] + [len(str(r[k])) for r in rows]) for k, t in cols}
    keep = {"host", "verdict"}
    if width > 0:
        floor = {k: max(len(t), 12) if k not in keep else widths[k] for k, t in cols}
        while sum(widths.values()) + 2 * (len(cols) - 1) > width:
            k = max((c for c, _ in cols if c not in keep), key=lambda c: widths[c] - floor[c])
            if widths[k] <= floor[k]:
                break  # narrower than every column's floor: the table runs past the width, nothing is lost
            widths[k] -= 1
    out = ["  ".join(t.ljust(widths[k]) for k, t in cols).rstrip()]
    for r in rows:
        cells = {k: terminal.wrap(str(r[k]), widths[k] if width > 0 and k not in keep else 0) for k, _ in cols}
        for i in range(max(len(c) for c in cells.values())):
            out.append("  ".join((cells[k][i] if i < len(cells[k]) else "").ljust(widths[k])
                                 for k, _ in cols).rstrip())
    return out


def render(doc: dict, width: int = 0) -> str:
    """The fleet's text page; `width` > 0 fits the table to a terminal (piped or to a file: 0, not wrapped)."""
    # every cell is host-provided or copied from a saved report: no control character reaches the terminal
    rows = [{k: (terminal.line(v) if isinstance(v, str) else [terminal.line(x) for x in v] if isinstance(v, list)
                 else v) for k, v in r.items()} for r in host_rows(doc)]
    cols = [("host", "HOST"), ("verdict", "VERDICT"), ("version", "VLLM"), ("backend", "BACKEND"),
            ("prefill", "PREFILL ENTRY"), ("decode", "DECODE ENTRY")]
    out = _table(rows, cols, width)
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
    if fl.get("retry_file") and fl.get("retry"):  # after an all-OK audit there is nothing to re-run
        out.append(f"re-run the {len(fl.get('retry') or [])} that did not pass: "
                   f"--limit @{terminal.line(fl['retry_file'])}")
    if width > 0:  # below the table too: each line wrapped to the terminal, continuation indented, no word lost
        head, _, rest = "\n".join(out).partition("\n\n")
        out = head.split("\n") + [""] + [w for ln in rest.split("\n")
                                          for w in ([ln] if len(ln) <= width else _wrapped(ln, width))]
    return terminal.text("\n".join(out)) + "\n"


def _wrapped(line: str, width: int) -> list[str]:
    first, *more = terminal.wrap(line, width - 4)
    return [first] + ["    " + m for m in more]


def h_status(row: dict) -> str:
    """A saved report's host without a verdict (an older or hand-made report: `report render` reads any)"""
    return "error" if row.get("error") else "?"
