"""The first screen of a one-host report: the answer to the on-call question, fitted to the terminal.

`answer(host)` is pure: from a host report (the JSON contract's host dict, or a HostReport) it gathers what the
first screen says — the answer the report holds (`hosts[].answer`, computed where the report is built by
diagnosis/answer.py: the backend and why, what a 1-token and a long prompt do, whether the *served model* is
sparse, the problems with their action), the install, the model and server as found, and for a live run the
verdict per prompt (expected vs observed path, with the reason code) and the restore. A writer diagnoses nothing.
`screen(...)` lays that out in at most ~15 lines no wider than the terminal; `verdict_cell(host)` is the one-cell
summary the fleet Markdown/HTML show. Colour (severity) only when asked: the caller decides (a terminal, no
NO_COLOR)."""
from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass, field
from typing import Any

from mla_doctor import terminal
from mla_doctor.report_sections import ModelSection, ServerSection, VllmSection
from mla_doctor.results import HostReport, host_to_dict

LABEL = 11  # the left column: "  " + label padded + " "
MAX_PROBLEMS = 4
SCREEN_LINES = 15  # the first screen's budget (a host's lines, header included)
STYLE = {"fail": "bold red", "warn": "yellow", "ok": "green", "info": "dim", "error": "bold magenta",
         "unreachable": "bold magenta", "head": "bold"}


# --------------------------------------------------------------------------- facts

def _short(symbol: str | None) -> str:
    return (symbol or "?").rsplit(".", 1)[-1]






@dataclass
class Problem:
    severity: str
    code: str
    summary: str
    action: str = ""


@dataclass
class PromptVerdict:
    name: str
    tokens: Any
    expected: str
    observed: str
    code: str | None
    severity: str


@dataclass
class Answer:
    """What the first screen shows: the report's stored answer (`hosts[].answer`, diagnosis/answer.py's
    HostAnswer) with the install, model, server and a live run's verdicts said from the report's own fields."""
    host: str
    verdict: str
    error: str | None = None
    install: str = ""
    backend: str = ""
    backend_name: str | None = None
    backend_source: str = ""  # log | run | platform | unknown
    dispatch: str | None = None
    family_layer: str | None = None  # a model-private family's layer (code_paths), shown instead of the dispatch
    one_token: str = ""
    long_prompt: str = ""
    threshold: str | None = None
    entry_short: str | None = None  # the 1-token prompt's entry symbol
    entry_long: str | None = None  # the long prompt's entry symbol
    model: str = ""
    model_sparse: bool | None = None
    server: str = ""
    problems: list[Problem] = field(default_factory=list)
    info_count: int = 0
    prompts: list[PromptVerdict] = field(default_factory=list)
    restored: str | None = None
    restored_ok: bool | None = None
    run: str | None = None


_STORED = ("backend", "backend_name", "backend_source", "dispatch", "family_layer", "one_token", "long_prompt",
           "threshold", "entry_short", "entry_long", "model_sparse", "info_count")


def _as_dict(h: HostReport | dict) -> dict:
    return host_to_dict(h) if isinstance(h, HostReport) else h


def _reason_for(findings: list[dict], p: dict) -> tuple[str | None, str]:
    """The first finding naming this prompt: the findings come worst first, in rule order."""
    label = f"prompt {p.get('name')!r} ("
    cfg = p.get("configuration")
    for f in findings:
        s = f.get("summary") or ""
        if label in s and (not cfg or cfg == "production" or f", {cfg})" in s):
            return f.get("code"), f.get("severity") or "info"
    return None, "info"


def answer(host: HostReport | dict) -> Answer:
    """The first screen's content: the stored answer, rendered; nothing here is diagnosed."""
    h = _as_dict(host)
    a = Answer(host=h.get("host", "?"), verdict=h.get("verdict") or "?")
    if h.get("status") not in (None, "ok"):
        a.error = h.get("error")
        return a
    v = VllmSection.of(h.get("vllm"))
    version, dist, kind = v.version, v.distribution, v.install_kind
    a.install = (f"vLLM {version} ({', '.join(x for x in (dist, kind) if x)})"
                 + ("" if v.get("known_version", True) else f" — unknown release, read as {v.knowledge_nearest}")
                 + f" at {v.path}; python {v.python_version or '?'} ({v.located_by})")
    findings = h.get("findings") or []
    stored = h.get("answer") if isinstance(h.get("answer"), dict) else {}
    for name in _STORED:
        if name in stored:
            setattr(a, name, stored[name])
    if not stored:
        a.backend_source = "unknown"
    a.problems = [Problem(p.get("severity", "?"), p.get("code", "?"), p.get("summary", ""), p.get("action") or "")
                  for p in stored.get("problems") or []]
    # ---- the served model
    model = ModelSection.of(h.get("model"))
    cls = model.classification
    what = model.argument or model.config_path
    if cls:
        kind_txt = ("not MLA" if cls.get("is_mla") is False else
                    "MLA, SPARSE (DSA)" if cls.get("is_sparse") else "MLA, not sparse")
        a.model = f"{kind_txt} — {what}: {cls.get('reason')}"
        if cls.get("startup_failure"):
            a.model += f"; will not start: {cls['startup_failure']}"
    else:
        a.model = ("not found (no running server, no --model): sparse or not cannot be told — give --model"
                   if not model else f"{what}: not classified")
    srv = ServerSection.of(h.get("server"))
    if srv.running:
        sup = srv.supervisor.get("kind")
        a.server = (f"pid {srv.pid} as {srv.user} under {sup}, port {srv.port}, "
                    f"tp {srv.tensor_parallel_size or 1}")
    else:
        a.server = "no vLLM server running"
    # ---- a live run: the verdict per prompt, then the restore
    for p in h.get("prompts") or []:
        exp, obs = p.get("expected") or {}, p.get("observed") or {}
        code, sev = _reason_for(findings, p)
        name = p.get("name", "?") + ("" if p.get("configuration") in (None, "production")
                                     else f" ({p['configuration']})")
        # "mha|mqa": the route depends on a fact the run could not know (routing conditions; -v names them)
        exp_prefill = "mha or mqa" if exp.get("prefill") == "mha|mqa" else exp.get("prefill")
        a.prompts.append(PromptVerdict(name, p.get("prompt_tokens"), f"{exp_prefill}/{exp.get('decode')}",
                                       f"{obs.get('prefill')}/{obs.get('decode')}", code, sev))
    live = h.get("live")
    if live:
        settings = " ".join(f"{k}={val}" for k, val in (live.get("settings") or {}).items()) or "none"
        a.run = (f"{live.get('run_id')}: method {live.get('method')}, runtime {live.get('runtime')}, "
                 f"settings {settings}")
        restored = h.get("restored")
        a.restored_ok = restored
        problems = "; ".join(live.get("restore_problems") or [])
        a.restored = ("yes" if restored else "NO" if restored is False else "n/a") + (
            f" — {problems}" if problems else
            " (same greedy completion before and after)" if restored and live.get("restored_completion") is not None
            else "")
    return a


def verdict_cell(host: dict) -> str:
    """One cell for the fleet reports: the live verdict where the host ran one, else the static answer."""
    a = answer(host)
    if a.error is not None or host.get("status") not in (None, "ok"):
        return a.verdict
    if a.prompts:
        return "live: " + "; ".join(f"{p.name} {p.observed}" + (f" {p.code}" if p.code else "") for p in a.prompts) \
            + (f"; restored {a.restored.split(' ')[0]}" if a.restored else "")
    be = a.backend_name or ("backend ?" if a.backend_source != "platform" else "backend not logged")
    if a.entry_short is None:
        return f"{be}: not MLA"
    if a.model_sparse:
        return f"{be}: sparse model, 1 token → {_short(a.entry_short)}, long → {_short(a.entry_long)}"
    return f"{be}: 1 token → {_short(a.entry_short)}, over {a.threshold or '?'} → {_short(a.entry_long)}"


# --------------------------------------------------------------------------- layout

Segment = tuple[str, "str | None"]


def _row(label: str, text: str, width: int, style: str | None = None, max_lines: int = 2) -> list[list[Segment]]:
    """`  label     text`, the text wrapped under itself, at most max_lines lines (the last cut with …)."""
    avail = max(width - LABEL, 10)
    label, text = terminal.line(label), terminal.line(text)  # host-provided: no control reaches the terminal
    lines = textwrap.wrap(text, avail, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: avail - 1].rstrip() + "…"
    out = [[("  ", None), (label[: LABEL - 3].ljust(LABEL - 3), style), (" " + lines[0], None)]]
    out += [[(" " * LABEL, None), (ln, None)] for ln in lines[1:]]
    return out


def screen(host: HostReport | dict, width: int, verbose: int = 0) -> list[list[Segment]]:
    """The first screen of one host, as lines of (text, style) segments, none wider than `width`."""
    a = answer(host)
    head = terminal.line(f"== {a.host}: {a.verdict.upper()}")
    head_line: list[Segment] = [(head[:width], STYLE.get(a.verdict, "head"))]
    lines: list[list[Segment]] = []
    if a.error is not None:
        return [head_line] + _row("error", a.error or "", width, STYLE.get(a.verdict), max_lines=6)
    for p in a.prompts:
        style = STYLE["ok"] if p.severity == "info" else STYLE.get(p.severity)
        lines += _row(p.name, f"{p.tokens} tok: expected {p.expected}, observed {p.observed}"
                      + (f" — {p.code}" if p.code else ""), width, style)
    if a.prompts:
        lines += _row("", "(prefill/decode path; reason code; -v for counts and why)", width, max_lines=1)
    if a.restored is not None:
        lines += _row("restored", a.restored, width,
                      STYLE["ok"] if a.restored_ok else STYLE["fail"] if a.restored_ok is False else None)
    lines += _row("install", a.install, width)
    lines += _row("backend", a.backend, width)
    optional: list[list[list[Segment]]] = []  # dropped, last first, when the screen would pass SCREEN_LINES
    if not a.prompts:
        if a.dispatch:
            dispatch = _row("dispatch", f"{a.dispatch} splits each step at the decode threshold", width, max_lines=1)
            optional.append(dispatch)
            lines += dispatch
        elif a.family_layer:
            layer = _row("layer", a.family_layer, width, max_lines=2)
            optional.append(layer)
            lines += layer
        lines += _row("1 token", a.one_token, width)
        lines += _row("long", a.long_prompt, width)
    lines += _row("model", a.model, width, STYLE["fail"] if a.model_sparse else None)
    server = _row("run", a.run, width) if a.run else _row("server", a.server, width, max_lines=1)
    optional.append(server)
    lines += server
    if not a.problems:
        lines += _row("problems", f"none ({a.info_count} info finding(s) under -v)", width, STYLE["ok"], max_lines=1)
    for p in a.problems[:MAX_PROBLEMS]:
        lines += _row(p.severity.upper(), f"{p.code}: {p.summary}", width, STYLE[p.severity])
        if p.action:
            lines += _row("", f"→ {p.action}", width, max_lines=1)
    if len(a.problems) > MAX_PROBLEMS:
        lines += _row("", f"… {len(a.problems) - MAX_PROBLEMS} more problem(s): -v", width, max_lines=1)
    if not verbose:
        hint = _row("", "-v: every entry, threshold and finding with its evidence", width, "dim", max_lines=1)
        optional.append(hint)
        lines += hint
    while optional and 1 + len(lines) > SCREEN_LINES:
        drop = optional.pop()
        lines = [ln for ln in lines if not any(ln is d for d in drop)]
    return [head_line] + lines


def plain(lines: list[list[Segment]]) -> str:
    return "".join("".join(t for t, _ in ln).rstrip() + "\n" for ln in lines)


def coloured(lines: list[list[Segment]]) -> str:
    """The same lines with their styles as ANSI colours (rich); the caller only asks on a terminal."""
    from rich.console import Console
    from rich.text import Text

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="standard", width=100_000, highlight=False,
                      emoji=False, no_color=False, legacy_windows=False)
    for ln in lines:
        text = Text(no_wrap=True, end="")
        for t, style in ln:
            text.append(t, style=style or "")
        console.print(text, soft_wrap=True)
    return buf.getvalue()


def fit(line: str, width: int) -> list[str]:
    """One detail line wrapped to the width, continuation lines indented under it (controls shown escaped)."""
    line = terminal.line(line)
    if len(line) <= width:
        return [line]
    indent = " " * min(len(line) - len(line.lstrip(" ")) + 4, width // 2)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False,
                         drop_whitespace=True) or [line[:width]]
