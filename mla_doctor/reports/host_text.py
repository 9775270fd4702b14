"""Human-readable rendering of a RunReport (the only place, with the CLI, that formats for people).

Each host starts with its first screen (reports/first_screen.py: the answer in words, ~18 lines fitted to the
width); `verbose` >= 1 adds every entry and detail below it. No line is wider than `width`, except a patch's
unified diff and its undo command (kept whole, so that they can be applied and copied)."""
from __future__ import annotations

import json
import shutil

from mla_doctor.threshold_text import fmt_threshold
from mla_doctor.words import platform_name
from mla_doctor import terminal
from mla_doctor.reports import first_screen
from mla_doctor.report_sections import (GpuSection, HostAnswer, ModelSection, PatchSection, RevertSection,
                                        ServerSection, StaticSection, VllmSection)
from mla_doctor.results import HostReport, HostStatus, RunReport

_MARK = {"info": "  ", "warn": "! ", "fail": "X "}


def _sym(ref: dict | None) -> str:
    if not ref or not ref.get("symbol"):
        return "-"
    loc = ref.get("file") or "?"
    if ref.get("line"):
        loc += f":{ref['line']}"
    flag = "" if ref.get("confirmed", True) else "  (NOT confirmed)"
    return f"{ref['symbol']}  {loc}{flag}"


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)  # int/str keys


def _threshold_lines(s: StaticSection) -> list[str]:
    """The decode thresholds of the knowledge beside those the agent read from the installed code."""
    th, code = s.decode_thresholds, s.threshold_code
    out = ["   decode thresholds: " + ", ".join(f"{k}={fmt_threshold(v)}"
                                                for k, v in sorted(th.items()))] if th else []
    if not code:
        return out
    out.append("   decode thresholds (knowledge | installed code):")
    for name in sorted(set(th) | set(code)):
        c = code.get(name) or {}
        know = fmt_threshold(th[name]) if name in th else "-"
        got = fmt_threshold(c["value"]) if "value" in c else "not read"
        flag = "" if name not in th or "value" not in c or _same(th[name], c["value"]) else "  DIFFERS"
        ref = str(c.get("ref") or "").rsplit("/", 1)[-1]  # file:line Class: the directory is in the decode list
        out.append(f"     {name:<26} {know} | {got}{'  ' + ref if ref else ''}{flag}")
    return out


def _routing_lines(h: HostReport) -> list[str]:
    """The routing conditions, resolved (with their source) and not, as the report's answer holds them: per prompt
    sent in a live run, else for a 1-token and a 4096-token prompt from what the static audit knows."""
    out = []
    a = HostAnswer.from_dict(h.answer)
    for r in a.routes if a is not None else []:
        out.append(f"   routing, {r.label}: {r.text}")
        if r.resolved:
            out.append("     conditions resolved: " + ", ".join(f"{k}={v}" for k, v in r.resolved.items()))
        if r.unresolved:
            out.append("     conditions unresolved: " + "; ".join(r.unresolved))
    return out


_ENTRIES = (("dispatch", "dispatch"), ("prefill_entry", "prefill"), ("decode_entry", "decode"))


def _entry_lines(s: StaticSection) -> list[str]:
    """The top-level entries (the served model's when its family has its own layer, entries_from), per platform
    when the host's platform is unknown and the family builds a layer per platform."""
    src = s.extra_.get("entries_from") if isinstance(s.extra_.get("entries_from"), dict) else None
    none = "none (the served family's layer has no such entry)" if src else "-"
    per = (src or {}).get("per_platform") if (src or {}).get("depends_on_platform") else None
    if per:
        out = ["   entries:   depend on the platform (the host's is unknown), the served family's layer per "
               "platform:"]
        generic = s.extra_.get("generic_split") if isinstance(s.extra_.get("generic_split"), dict) else {}
        for plat, e in per.items():
            out.append(f"     - [{platform_name(plat)}] {e.get('layer')}")
            for k, label in _ENTRIES:
                v = e.get(k)
                text = (f"{_sym(generic.get(k))}  (the shared split's, called by the family's layer)"
                        if v == "generic" else _sym(v) if isinstance(v, dict) else none)
                out.append(f"         {label + ':':<10} {text}")
        return out
    out = [f"   {label + ':':<10} {_sym(getattr(s, k)) if getattr(s, k) else none}" for k, label in _ENTRIES]
    if src:
        out.append(f"   entries:   the served model's, from its layer {src.get('layer')} (the generic split: "
                   "generic_split)")
    return out


def render_host(h: HostReport) -> list[str]:
    out = [f"== {h.host}: {h.verdict().upper()}"]
    if h.status != HostStatus.OK:
        out.append(f"   {h.error}")
        return out
    v = VllmSection.of(h.vllm)
    out.append(f"   vLLM {v.version} ({v.distribution}, {v.install_kind}) at {v.path}")
    out.append(f"   python {v.python} [{v.python_version}], located by {v.located_by}")
    s = StaticSection.of(h.static)
    eng = s.engine or {}
    out.append(f"   engine: {eng.get('default') if isinstance(eng, dict) else eng}   nearest known release: "
               f"{v.knowledge_nearest}" + ("" if v.known_version else "  (UNKNOWN VERSION: best effort)"))
    out += _entry_lines(s)
    served = s.served
    if served and not served.get("generic"):  # the served model's own layer, from the installed code
        taken = served.get("platform_taken")
        where = f"on {platform_name(taken)}" if taken else "platform unknown: each platform's layer"
        out.append(f"   family:    {served.get('family')} ({served.get('architecture')} -> "
                   f"vllm/{served.get('module')}; {where}) — prefill {served.get('prefill')}")
        for lp in served.get("layers") or []:
            if served.get("platform_taken") and lp.get("platform") != served.get("platform_taken"):
                continue
            out.append(f"     - [{platform_name(lp.get('platform'))}] {lp.get('class')} {lp.get('ref')}: decode "
                       + "; ".join(lp.get("decode") or ["?"])
                       + ("; prefill " + "; ".join(lp["prefill_entries"]) if lp.get("prefill_entries") else ""))
    for d in s.decode_entries:
        out.append(f"     - {d.get('backend', ''):<22} {_sym(d)}")
    gate = s.sparse_gate
    out.append(f"   sparse:    {'gate present' if gate.get('present') else 'no sparse (DSA) support'}"
               + (f" — {gate.get('routing')}" if gate.get("routing") else ""))
    out += _threshold_lines(s)
    out += _routing_lines(h)
    out.append(f"   integrity: {s.integrity}; modified {len(s.modified_files)}, "
               f"missing {len(s.missing_files)}, unrecorded {len(s.unrecorded_files)}")
    srv = ServerSection.of(h.server)
    if srv.running:
        out.append(f"   server: pid {srv.pid} user {srv.user} port {srv.port} "
                   f"supervisor {srv.supervisor.get('kind')} tp={srv.tensor_parallel_size or 1}")
    model = ModelSection.of(h.model)
    if model.classification:
        c = model.classification
        out.append(f"   model: {model.argument} type={c.get('model_type')} mla={c.get('is_mla')} "
                   f"sparse={c.get('is_sparse')}")
    gpu = GpuSection.of(h.gpu)
    if gpu.present:
        out.append("   gpu: " + ", ".join(f"{g['name']} (sm {g['compute_cap']})" for g in gpu.gpus))
    out.append("   findings:")
    for f in h.findings:
        out.append(f"   {_MARK[f.severity.value]}[{f.severity.value}] {f.code}: {f.summary}")
        for e in f.evidence[:8]:
            out.append(f"        {e}")
        if len(f.evidence) > 8:
            out.append(f"        ... {len(f.evidence) - 8} more")
        if f.action and f.severity.value != "info":
            out.append(f"        -> {f.action}")
    return out


def render_patch(h: HostReport) -> list[str]:
    p = PatchSection.of(h.patch)
    out = [f"   run id:   {p.run_id}  (method {p.method}{', DRY RUN' if p.dry_run else ''})",
           f"   outcome:  {p.outcome}"]
    if p.records_dir:
        out.append(f"   records:  {p.records_dir}/probe-<pid>.jsonl")
    lease = p.lease
    if lease:
        exp = lease.get("expires")
        out.append("   lease:    " + ("no expiry (--ttl 0: no watchdog; revert by hand)" if not exp else
                                      f"{lease.get('ttl'):g}s, watchdog pid {p.watchdog_pid} reverts "
                                      f"if not renewed"))
    if p.get("plugin"):
        env = p["plugin"]["env"]
        out.append(f"   plugin:   start the server with PYTHONPATH={env['PYTHONPATH']} "
                   f"(and add {env['VLLM_PLUGINS_ADD']} to VLLM_PLUGINS if that is set)")
    for f in p.files:
        out.append(f"   {f.get('outcome', '?'):<16} vllm/{f['rel']}  {str(f.get('original_sha256'))[:12]} -> "
                   f"{str(f.get('patched_sha256'))[:12]}")
        if f.get("diff"):
            out += ["      " + ln for ln in f["diff"].rstrip("\n").splitlines()]
    for m in p.missing_symbols:
        out.append(f"   missing:  {m}")
    for r in p.get("refused") or []:
        out.append(f"   refused:  {r}")
    if p.run_id and p.outcome == "patched":
        undo = p.undo or f"mla-doctor revert --host {h.host} --run {p.run_id}"
        out.append(f"   undo:     {undo}")
    return out


def render_live(h: HostReport) -> list[str]:
    live = h.live or {}
    settings = ", ".join(f"{k}={v}" for k, v in (live.get("settings") or {}).items()) or "its own settings only"
    out = [f"   run {live.get('run_id')}: method {live.get('method')}, runtime {live.get('runtime')}, "
           f"configuration {live.get('configuration')} ({settings})"]
    for name, why in (live.get("prompts_skipped") or {}).items():
        out.append(f"   not sent: prompt {name}: {why}")
    if live.get("settings_not_applied"):
        skipped = ", ".join(f"{k}={v}" for k, v in live["settings_not_applied"].items())
        out.append(f"   not applied: {skipped} — {live.get('settings_note')}")
    if h.prompts:
        out.append(f"   {'prompt':<13}{'tokens':>7}  {'forward_mha calls/tokens':>25}  {'forward_mqa calls/tokens':>25}"
                   f"  expected -> observed")
        for p in h.prompts:
            mha = p["calls"].get("forward_mha") or {"calls": 0, "tokens": 0}
            mqa = p["calls"].get("forward_mqa") or {"calls": 0, "tokens": 0}
            exp, obs = p.get("expected") or {}, p.get("observed") or {}
            out.append(f"   {p['name']:<13}{p['prompt_tokens']:>7}  {mha['calls']:>12}/{mha['tokens']:<12}"
                       f"  {mqa['calls']:>12}/{mqa['tokens']:<12}  prefill {exp.get('prefill')}->{obs.get('prefill')}, "
                       f"decode {exp.get('decode')}->{obs.get('decode')}")
            if exp.get("why"):
                out.append(f"   {'':<13}{'':>7}  why: {exp['why']}")
            res = (p.get("routing") or {}).get("resolution")
            if res:  # the conditional route, and which branch the probe's observation showed
                out.append(f"   {'':<13}{'':>7}  {res.get('text')}")
    restored = h.restored
    out.append("   restored: " + ("yes" if restored else "NO" if restored is False else "n/a")
               + (f" — {'; '.join(live.get('restore_problems') or [])}" if live.get("restore_problems") else "")
               + (f" (same greedy completion before and after: {live.get('restored_completion')!r})"
                  if restored and live.get("restored_completion") is not None else ""))
    return out


def render_revert(h: HostReport) -> list[str]:
    r = RevertSection.of(h.revert)
    out = []
    if not r.runs:
        out.append("   nothing to revert: no run left patches on this host")
    for run in r.runs:
        out.append(f"   run {run.get('run_id')}: {run.get('state')}{' (dry run)' if r.dry_run else ''}")
        for f in run.get("files") or []:
            if isinstance(f, str):
                out.append(f"      would restore vllm/{f}")
            else:
                out.append(f"      {f.get('outcome'):<16} {f.get('path')}")
                if f.get("kept"):
                    out.append(f"         kept both: {f['kept']['original']} and {f['kept']['current']}")
    return out


VERBATIM = ("      ", "   undo:")  # diff lines, the undo command


def _fitted(lines: list[str], width: int) -> list[str]:
    out: list[str] = []
    for ln in lines:
        out += first_screen.fit(ln, width)
    return out


def render(report: RunReport, verbose: int = 0, width: int | None = None, color: bool = False) -> str:
    """The report for people: `verbose` 0 is the first screen, 1+ adds every detail; `width` defaults to the
    terminal's columns, 0 is not wrapped (piped: a line stays whole for grep and for the reader's own terminal);
    `color` (severity in colour) only when the caller writes to a terminal."""
    width = 0 if width == 0 else max(int(width or shutil.get_terminal_size().columns), 40)
    text = ""
    for h in report.hosts:
        if report.command == "revert":
            lines = [f"== {h.host}: {h.verdict().upper()}"] + ([f"   {h.error}"] if h.error else []) + render_revert(h)
            text += "\n".join(_fitted(lines, width)) + "\n"
        else:
            rows = first_screen.screen(h, width, verbose)
            text += first_screen.coloured(rows) if color else first_screen.plain(rows)
            if verbose and h.status == HostStatus.OK:  # a host not audited: its error is all there is
                detail = render_host(h)[1:] + (render_live(h) if h.live else [])
                text += "\n".join(["   details:"] + _fitted(detail, width)) + "\n"
            if h.patch and not h.live:
                patch = render_patch(h)
                # a diff and the undo command stay whole: they are applied and copied, never read wrapped
                text += "\n".join(terminal.line(ln) if ln.startswith(VERBATIM)
                                   else "\n".join(first_screen.fit(ln, width))
                                   for ln in patch) + "\n"
        text += "\n"
    counts: dict[str, int] = {}
    for h in report.hosts:
        counts[h.verdict()] = counts.get(h.verdict(), 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    last = (f"overall: {report.overall().upper()} ({summary}) in {report.duration_s:.2f}s "
            f"— exit {int(report.exit_status())} ({report.exit_status().name})")
    return text + "\n".join(first_screen.fit(last, width)) + "\n"
