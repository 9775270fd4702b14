"""The first screen of a one-host report: the answer to the on-call question, fitted to the terminal.

`answer(host)` is pure: from a host report (the JSON contract's host dict, or a HostReport) it gathers what the
first screen says — the answer the report holds (`hosts[].answer`, computed where the report is built by
diagnosis/answer.py: the backend and why, what a 1-token and a long prompt do, whether the *served model* is
sparse, the problems with their action), the install, the model and server as found, and for a live run the
verdict per prompt (expected vs observed path, with the reason code) and the restore. A writer diagnoses nothing.
`screen(...)` lays that out in ~18 lines, the answer in words first, wrapped to the terminal without losing a
word (piped: not wrapped); `verdict_cell(host)` is the one-cell summary the fleet Markdown/HTML show. Colour
(severity) only when asked: the caller decides (a terminal, no NO_COLOR)."""
from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mla_doctor import terminal
from mla_doctor.report_sections import HostAnswer, ModelSection, ServerSection, VllmSection
from mla_doctor.results import HostReport, host_to_dict

LABEL = 11  # the left column: "  " + label padded + " "
MAX_PROBLEMS = 4
SCREEN_LINES = 18  # the first screen's budget (a host's lines, header included): fits a 24-line terminal
STYLE = {"fail": "bold red", "warn": "yellow", "ok": "green", "info": "dim", "error": "bold magenta",
         "unreachable": "bold magenta", "head": "bold"}


# --------------------------------------------------------------------------- facts

def _short(symbol: str | None) -> str:
    return (symbol or "?").rsplit(".", 1)[-1]


@dataclass
class PromptVerdict:
    name: str
    tokens: Any
    expected: str
    observed: str
    code: str | None
    severity: str
    words: str = ""  # the verdict as a sentence: which entry ran, why, whether that is expected, then the code


@dataclass
class Screen:
    """What the first screen shows: the report's stored answer (`hosts[].answer`, diagnosis/answer.py's, as it is)
    with the install, model, server and a live run's verdicts said from the report's own fields."""
    host: str
    verdict: str
    answer: HostAnswer = field(default_factory=HostAnswer)
    error: str | None = None
    install: str = ""
    backend_source: str = ""  # the answer's, or "unknown" for a report that holds none
    model: str = ""
    server: str = ""
    prompts: list[PromptVerdict] = field(default_factory=list)
    restored: str | None = None
    restored_ok: bool | None = None
    run: str | None = None


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


def answer(host: HostReport | dict) -> Screen:
    """The first screen's content: the stored answer, rendered; nothing here is diagnosed."""
    if isinstance(host, HostReport):
        host = host.redacted()  # its answer is read typed, as it was built; the rest as its JSON
    h = _as_dict(host)
    a = Screen(host=h.get("host", "?"), verdict=h.get("verdict") or "?")
    if h.get("status") not in (None, "ok"):
        a.error = h.get("error")
        return a
    v = VllmSection.of(h.get("vllm"))
    version, dist, kind = v.version, v.distribution, v.install_kind
    a.install = (f"vLLM {version} ({', '.join(x for x in (dist, kind) if x)})"
                 + ("" if v.get("known_version", True) else f" — unknown release, read as {v.knowledge_nearest}")
                 + f" at {v.path}; python {v.python_version or '?'} ({v.located_by})")
    findings = h.get("findings") or []
    stored = host.answer if isinstance(host, HostReport) else h.get("answer")
    stored = stored if isinstance(stored, Mapping) else {}
    a.answer = HostAnswer.from_dict(stored)
    a.backend_source = a.answer.backend_source if stored else "unknown"
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
    srv = ServerSection.of(h.get("server"))
    if not cls:  # said with the server as this screen states it: never "no running server" above its pid
        a.model = (f"{what}: not classified" if model else
                   "not read from the running server's arguments, no --model: sparse or not cannot be told — give "
                   "--model" if srv.running else
                   "not found (no running server, no --model): sparse or not cannot be told — give --model")
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
                                       f"{obs.get('prefill')}/{obs.get('decode')}", code, sev,
                                       prompt_words(p, code, sev)))
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


def _entry(p: dict, path: str) -> str:
    """The entry the route names for this path (a family's own prefill), else the shared layer's."""
    sym = ((p.get("routing") or {}).get("route") or {}).get("symbol")
    if sym and path == "mha" and not sym.endswith("forward_mqa"):
        return _short(sym)
    return "forward_mha" if path == "mha" else "forward_mqa"


def prompt_words(p: dict, code: str | None, severity: str) -> str:
    """One prompt's live verdict as a sentence: which entry ran and why (the threshold as a number, the sparse
    route, a CUDA graph hiding calls), whether that is expected, then the reason code."""
    exp, obs = p.get("expected") or {}, p.get("observed") or {}
    n = p.get("prompt_tokens")
    who = f"the {n}-token prompt"
    thr = exp.get("threshold")
    thr_txt = f"the threshold of {thr} token{'' if thr == 1 else 's'}" if isinstance(thr, int) else "the threshold"
    pre, dec = obs.get("prefill"), obs.get("decode")
    if obs.get("sparse_steps"):
        what = f"{who} took the sparse (DSA) top-k route: forward_mqa for every token, so forward_mha is never reached"
    elif pre == "mha":
        what = f"{who} is over {thr_txt}, so its prefill ran {_entry(p, 'mha')}"
    elif pre == "mqa" and isinstance(thr, int) and isinstance(n, int) and n <= thr:
        what = f"{who} was decode-only (at or below {thr_txt}), so forward_mha is never reached: it ran forward_mqa"
    elif pre == "mqa":
        what = f"{who} ran forward_mqa, not forward_mha, for its prefill"
    else:
        what = f"no MLA entry ran for {who} (the probe saw no forward_mha or forward_mqa call)"
        if exp.get("prefill_hidden"):
            what += ": it replayed a CUDA graph, which hides the call"
    if dec == "mqa" and not obs.get("sparse_steps") and pre != "mqa":
        what += ", then forward_mqa for each output token"
    elif dec == "hidden":
        what += "; its decode steps replayed a CUDA graph, which hides the forward_mqa calls"
    expected = f"{exp.get('prefill')}/{exp.get('decode')}" == f"{pre}/{dec}" or (
        exp.get("prefill") == "mha|mqa" and pre in ("mha", "mqa") and exp.get("decode") == dec)
    if severity in ("fail", "warn", "error"):
        verdict = ("NOT as expected" if not expected else "as expected, but see the problem below") + \
            f" (expected prefill {str(exp.get('prefill')).replace('|', ' or ')}, decode {exp.get('decode')})"
    elif exp.get("prefill") == "mha|mqa":
        verdict = "either path was possible (facts the run could not know); the probe saw which"
    elif pre == "mqa" and not obs.get("sparse_steps") and expected:
        verdict = "this is expected, not a fault"
    else:
        verdict = "as expected" if expected else f"expected {exp.get('prefill')}/{exp.get('decode')}"
    return f"{what}; {verdict}" + (f" — {code}" if code else "")


def verdict_cell(host: dict) -> str:
    """One cell for the fleet reports: the live verdict where the host ran one, else the static answer."""
    a = answer(host)
    if a.error is not None or host.get("status") not in (None, "ok"):
        return a.verdict
    if a.prompts:
        return "live: " + "; ".join(f"{p.name} {p.observed}" + (f" {p.code}" if p.code else "") for p in a.prompts) \
            + (f"; restored {a.restored.split(' ')[0]}" if a.restored else "")
    ans = a.answer
    be = ans.backend_name or ("backend ?" if a.backend_source != "platform" else "backend not logged")
    if ans.entry_short is None:
        return f"{be}: not MLA"
    if ans.model_sparse:
        return f"{be}: sparse model, 1 token → {_short(ans.entry_short)}, long → {_short(ans.entry_long)}"
    return f"{be}: 1 token → {_short(ans.entry_short)}, over {ans.threshold or '?'} → {_short(ans.entry_long)}"


# --------------------------------------------------------------------------- layout

Segment = tuple[str, "str | None"]


def _row(label: str, text: str, width: int, style: str | None = None) -> list[list[Segment]]:
    """`  label     text`, the text wrapped under itself, every word kept (a path breaks after a `/`); `width`
    0: one line whatever its length (piped output is not wrapped)."""
    avail = max(width - LABEL, 10) if width > 0 else 0
    label = terminal.line(label)  # host-provided: no control reaches the terminal
    lines = terminal.wrap_lines(text, avail) or [""]  # a multi-line error as lines (only \n breaks one)
    out = [[("  ", None), (label[: LABEL - 3].ljust(LABEL - 3), style), (" " + lines[0], None)]]
    out += [[(" " * LABEL, None), (ln, None)] for ln in lines[1:]]
    return out


def screen(host: HostReport | dict, width: int, verbose: int = 0) -> list[list[Segment]]:
    """The first screen of one host, as lines of (text, style) segments, none wider than `width` (0: not
    wrapped). The answer first, in words; nothing is cut: past the budget, the optional rows go, never words."""
    a = answer(host)
    head = [[(t, STYLE.get(a.verdict, "head"))] for t in terminal.wrap(f"== {a.host}: {a.verdict.upper()}", width)]
    lines: list[list[Segment]] = []
    if a.error is not None:
        return head + _row("error", a.error or "", width, STYLE.get(a.verdict))
    for p in a.prompts:
        style = STYLE["ok"] if p.severity == "info" else STYLE.get(p.severity)
        lines += _row(p.name, p.words or (f"{p.tokens} tok: expected {p.expected}, observed {p.observed}"
                                          + (f" — {p.code}" if p.code else "")), width, style)
    optional: list[list[list[Segment]]] = []  # dropped, last first, when the screen would pass SCREEN_LINES
    if a.restored is not None:
        lines += _row("restored", a.restored, width,
                      STYLE["ok"] if a.restored_ok else STYLE["fail"] if a.restored_ok is False else None)
    if not a.prompts:
        lines += _row("1 token", a.answer.one_token_words or a.answer.one_token, width)
        lines += _row("long", a.answer.long_prompt_words or a.answer.long_prompt, width)
    lines += _row("backend", a.answer.backend, width)
    if not a.prompts:
        if a.answer.dispatch:
            dispatch = _row("dispatch", f"{a.answer.dispatch} splits each step at the decode threshold", width)
            optional.append(dispatch)
            lines += dispatch
        elif a.answer.family_layer:
            layer = _row("layer", a.answer.family_layer, width)
            optional.append(layer)
            lines += layer
    install = _row("install", a.install, width)
    lines += install
    lines += _row("model", a.model, width, STYLE["fail"] if a.answer.model_sparse else None)
    server = _row("run", a.run, width) if a.run else _row("server", a.server, width)
    optional.append(server)
    lines += server
    if not a.answer.problems:
        lines += _row("problems", f"none ({a.answer.info_count} info finding(s) under -v)", width, STYLE["ok"])
    for p in a.answer.problems[:MAX_PROBLEMS]:
        lines += _row(p.severity.upper(), f"{p.code}: {p.summary}", width, STYLE[p.severity])
        if p.action:
            lines += _row("", f"→ {p.action}", width)  # whole: the action is what the reader does next
    if len(a.answer.problems) > MAX_PROBLEMS:
        lines += _row("", f"… {len(a.answer.problems) - MAX_PROBLEMS} more problem(s): -v", width)
    if not verbose:
        hint = _row("", "-v: every entry, threshold and finding with its evidence", width, "dim")
        optional.append(hint)
        lines += hint
    optional.insert(0, install)  # the install goes last of all (it is also under -v)
    while optional and len(head) + len(lines) > SCREEN_LINES:
        drop = optional.pop()
        lines = [ln for ln in lines if not any(ln is d for d in drop)]
    return head + lines


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
    """One detail line wrapped to the width, continuation lines indented under it (controls shown escaped); no
    word lost, a path broken after a `/`; `width` 0: not wrapped."""
    line = terminal.line(line)
    if width <= 0 or len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    indent = " " * min(lead + 4, width // 2)
    first, *rest = terminal.wrap(line[lead:], width - len(indent))
    return [" " * lead + first] + [indent + ln for ln in rest]
