"""The answer to the on-call question for one host (`HostAnswer`), computed where the report is built and stored in
it (`hosts[].answer`): the backend this host selects (from the log or the run) or would select (the platform's choice
for this release, said as such), what a 1-token and a long prompt do (entry symbol, decode threshold as a number or a
range; the routing conditions resolved and not), whether the *served model* is sparse, and the problems (fail, then
warn) with their action. The writers (reports/) render it and never re-derive it: they read no knowledge."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mla_doctor import words
from mla_doctor.threshold_text import fmt_threshold, table_values
from mla_doctor.diagnosis.knowledge import Knowledge, load_knowledge
from mla_doctor.diagnosis.routing import CONDITION_NAMES, backend_from_argv, known_from_host, route, routes
from mla_doctor.report_sections import (EvidenceSection, GpuSection, HostAnswer, LogSection, ModelSection, Problem,
                                        RouteLine, ServerSection, StaticSection, VllmSection)
from mla_doctor.results import Finding, HostReport

LONG_TOKENS = 4096  # the long prompt the static answer speaks of


__all__ = ["HostAnswer", "Problem", "RouteLine", "answer_of", "fill_answers", "host_answer", "resolve_threshold"]


def _short(symbol: str | None) -> str:
    return (symbol or "?").rsplit(".", 1)[-1]


def _parts(h: HostReport | Mapping[str, Any]) -> Mapping[str, Any]:
    """The host's parts the answer reads: a HostReport's typed sections as they are (a section reads as its JSON),
    or a saved report's host dict."""
    if not isinstance(h, HostReport):
        return h
    return {"status": h.status.value, "vllm": h.vllm, "static": h.static, "model": h.model, "server": h.server,
            "log": h.log, "gpu": h.gpu, "evidence": h.evidence, "prompts": h.prompts, "findings": h.findings}


def _finding(f: Finding | Mapping[str, Any]) -> Problem:
    if isinstance(f, Finding):
        return Problem(f.severity.value, f.code, f.summary, f.action or "")
    return Problem(f.get("severity"), f.get("code", "?"), f.get("summary", ""), f.get("action") or "")


def resolve_threshold(value: Any, h: dict) -> Any:
    """A head-dependent table resolved for this host when its heads, TP and GPU are known; else as is."""
    if not isinstance(value, dict):
        return value
    cfg = ModelSection.of(h.get("model")).config
    heads = cfg.get("num_attention_heads")
    tp = ServerSection.of(h.get("server")).tensor_parallel_size or 1
    gpu = GpuSection.of(h.get("gpu"))
    if not isinstance(heads, int) or not isinstance(tp, int) or tp < 1:
        return value
    if "any" in value:
        table = value["any"]
    elif gpu.gpus:
        table = value.get("sm100" if gpu.compute_cap.startswith("10") else "other")
    else:
        return value
    if not isinstance(table, dict):
        return value
    local = str(heads // tp)
    got = table.get(local, table.get("default"))
    return got if isinstance(got, int) else value


def _log_text(line: Any) -> str:
    text = (line or {}).get("text", "") if isinstance(line, dict) else str(line or "")
    return text.split("] ", 1)[-1].strip() if "] " in text else text.strip()


def _platform_backend(h: dict, names: list[str], version: str | None) -> tuple[str, list[str]]:
    """(what the platform would select, said as such; the candidate backends) when the log does not say."""
    v = VllmSection.of(h.get("vllm"))
    gpu = GpuSection.of(h.get("gpu"))
    dense = [n for n in names if "SPARSE" not in n]
    cpu = [n for n in dense if n.startswith(("CPU_", "AMX_"))]
    if gpu.present and gpu.gpus:
        cuda = [n for n in dense if not n.startswith(("CPU_", "AMX_", "ROCM_")) and "XPU" not in n]
        cap = gpu.gpus[0].get("compute_cap")
        return (f"not in the log: the CUDA platform picks at start (sm {cap}) among {', '.join(cuda) or '?'}"
                " — give --log to know", cuda)
    if "cpu" in str(v.distribution or "").lower():
        if not cpu:
            return f"none: vLLM {version} has no MLA backend for the CPU platform (MLA fails at start)", []
        pick = cpu[0] + (f" ({', '.join(cpu[1:])} where the CPU has AMX)" if cpu[1:] else "")
        return f"{pick} — the CPU platform's choice in {version}, not seen in a log", cpu
    return ("not in the log, no NVIDIA GPU seen: the platform picks at start — give --log to know",
            [n for n in dense])


def _family_backend(fb: Any, generic: str) -> tuple[str, str | None] | None:
    """(the line, the name) for a family layer that names its own backend (code_paths.family_backend): it wins
    over the platform's generic selection. Without the host's branch known, each branch's is listed."""
    by = (fb or {}).get("by_platform") if isinstance(fb, dict) else None
    if not by:
        return None
    taken = fb.get("platform_taken")
    pick = generic.split(" — ", 1)[0].split(" (", 1)[0]  # "CPU_MLA (AMX_MLA where ...)" -> CPU_MLA
    pick = pick if pick.replace("_", "").isalnum() else "generic choice"  # "none: ...", "not in the log: ..."
    if taken and by.get(taken):
        got = by[taken]
        where = "; ".join(f"{b['named_by'].split(' ', 1)[0]} {b['named_at']} ({b['layer'].split(' ', 1)[0]}), "
                          f"get_name {b['get_name']}" for b in got)
        others = sorted({o for b in got for o in b.get("others") or []})
        more = f"; with {', '.join(others)}" if others else ""
        return (f"{' / '.join(b['name'] for b in got)} (not the platform's {pick}) — the family layer's own: "
                f"{where}{more}", got[0]["name"] if len(got) == 1 else None)
    per = "; ".join(f"on {words.platform_name(p)}: " + " / ".join(b["name"] for b in bs)
                    for p, bs in sorted(by.items()))
    return (f"the family layer's own backend, per platform (no GPU seen): {per} — not the platform's "
            "generic choice", None)


def _route_line(label: str, r: dict) -> RouteLine:
    # the route said in words (words.route: "forward_mha on NVIDIA SM100 with an unquantized KV cache and FA4,
    # otherwise forward_mqa"), never the route's code wording (r["text"]: "when SM100 and unquantized KV")
    text = words.route(r) if r.get("branches") else r.get("text") or ""
    return RouteLine(label, text, dict(r.get("resolved") or {}),
                     [CONDITION_NAMES.get(u, u) for u in r.get("unresolved") or []])


def host_answer(report: HostReport | Mapping[str, Any], kb: Knowledge | None = None) -> HostAnswer | None:
    """The answer for one host (its typed report, or a saved report's host dict); None for a host that was not
    audited."""
    h = _parts(report)
    if h.get("status") not in (None, "ok"):
        return None
    a = HostAnswer()
    st = StaticSection.of(h.get("static"))
    version = VllmSection.of(h.get("vllm")).version
    facts = (kb or load_knowledge()).for_version(version) if version else None
    findings = [_finding(f) for f in h.get("findings") or []]
    # ---- backend: the log (static) or the run's evidence, else the platform's choice for this release
    live_ev = EvidenceSection.of(h.get("evidence") if isinstance(h.get("evidence"), Mapping) else None)
    log_ev = LogSection.of(h.get("log")).evidence
    thresholds = st.decode_thresholds
    names = [e.get("backend") for e in st.decode_entries if e.get("backend")]
    names = list(dict.fromkeys(names + [n for n in thresholds if n not in names]))
    release_engine = st.engine
    if isinstance(release_engine, dict):
        release_engine = release_engine.get("default")
    engine = log_ev.get("engine") or live_ev.engine or release_engine
    candidates: list[str] = []
    if live_ev.decode_backend:
        a.backend_name, a.backend_source = live_ev.decode_backend, "run"
        a.backend = f"{a.backend_name} — selected, from the server's log during the run"
    elif log_ev.get("decode_backend"):
        a.backend_name, a.backend_source = log_ev["decode_backend"], "log"
        line = log_ev.get("decode_backend_line") or {}
        a.backend = (f"{a.backend_name} — selected, server log line {line.get('n', '?')}: "
                     f"\"{_log_text(line)}\"")
    else:
        a.backend_source = "platform"
        a.backend, candidates = _platform_backend(h, names, version)
        if len(candidates) == 1:
            a.backend_name = candidates[0]
        # no selection line: the backend the server's argv forces on the MLA layers (--attention-config
        # backend_per_kind[the MLA kind], else --attention-backend), as the route reads it (known_from_host)
        forced = backend_from_argv(ServerSection.of(h.get("server")).argv, st.code_paths)
        if forced and facts is not None and facts.backend(forced[0]) is not None:
            a.backend_name, a.backend_source, candidates = forced[0], "argv", [forced[0]]
            a.backend = f"{forced[0]} — forced by {forced[1]}; not seen in a log"
        own = _family_backend((st.code_paths or {}).get("family_backend"), a.backend)
        if own:
            a.backend, a.backend_name, a.family_backend = own[0], own[1] or a.backend_name, own[1]
    prefill_be = log_ev.get("prefill_backend") or live_ev.prefill_backend
    if prefill_be:
        a.backend += f"; prefill kernel {prefill_be}"
    if engine:
        a.backend += f"; engine {engine}"
    # ---- what a 1-token and a long prompt do
    pre = st.symbol("prefill_entry")
    dec = st.symbol("decode_entry")
    by_backend = {e.get("backend"): e.get("symbol") for e in st.decode_entries}
    dec = by_backend.get(a.backend_name) or dec  # the selected backend's own decode entry, when known
    a.dispatch = st.symbol("dispatch")
    if a.backend_name and a.backend_name in thresholds:
        thr_values = [resolve_threshold(thresholds[a.backend_name], h)]
    else:
        thr_values = [resolve_threshold(thresholds[n], h) for n in (candidates or names) if n in thresholds
                      and "SPARSE" not in n]
    nums = sorted({n for t in thr_values for n in ([t] if isinstance(t, int) else table_values(t)
                                                    if isinstance(t, dict) else [])})
    if len(thr_values) == 1 and not isinstance(thr_values[0], int):
        a.threshold = fmt_threshold(thr_values[0])
    elif nums:
        a.threshold = str(nums[0]) if len(nums) == 1 else f"{nums[0]}–{nums[-1]} (by backend)"
    thr_of = f" of {a.backend_name}" if a.backend_name and len(thr_values) == 1 else ""
    model = ModelSection.of(h.get("model"))
    cls = model.classification
    a.model_sparse = cls.get("is_sparse") if cls.get("is_mla") is not False else False
    mode = facts.sparse_mode if facts is not None else "none"
    a.entry_short, a.entry_long = dec, pre
    fam = None  # a model-private family's own layer (code_paths / the families table): its entries, not the table's
    if facts is not None and cls.get("is_mla") is not False and engine != "V0":
        known = known_from_host(h, facts)
        if known.family:
            fam = (route(facts, known, 1), route(facts, known, LONG_TOKENS), known.family.get("family"))
    nop = (st.code_paths or {}).get("served_not_on_platform")
    stub = isinstance(nop, dict) and a.backend_source in ("platform", "argv")
    if stub:
        # the platform's branch of the family is a stub that raises: no layer, no path, no backend to claim
        a.backend = (f"none: {nop.get('family')}'s layer on {words.platform_name(nop.get('platform'))} is a stub "
                     "that raises "
                     f"{nop.get('raises') or '?'}")
        a.backend_name = None
        a.one_token = a.long_prompt = (f"no path: the server cannot build this model on "
                                       f"{words.platform_name(nop.get('platform'))}: {nop.get('family')} has no "
                                       "layer there (see FAMILY_NOT_ON_PLATFORM)")
        a.entry_short = a.entry_long = a.dispatch = None
        a.one_token_words = a.long_prompt_words = (
            f"no prompt runs: {nop.get('family')} has no working layer on {words.platform_name(nop.get('platform'))} "
            f"(its branch raises {nop.get('raises') or '?'}), so the server cannot start this model here — "
            "FAMILY_NOT_ON_PLATFORM")
    elif cls.get("is_mla") is False:
        a.one_token = a.long_prompt = ("generic attention, not MLA: no forward_mha/forward_mqa split "
                                       f"({cls.get('reason')})")
        a.entry_short = a.entry_long = None
        a.one_token_words = a.long_prompt_words = (
            "the model is not MLA, so neither forward_mha nor forward_mqa runs: it uses generic attention "
            f"({cls.get('reason')})")
    elif engine == "V0":
        a.one_token = f"→ {pre} (V0: a prompt is always a prefill); each output token → {_short(dec)}"
        a.long_prompt = f"→ {pre} (prefill); each output token → {_short(dec)}"
        a.entry_short = pre
        a.one_token_words = (f"a 1-token prompt is a prefill under the V0 engine (V0 splits by request phase, not "
                             f"by a threshold), so it runs {_short(pre)}; each output token runs {_short(dec)} — "
                             "expected for V0")
        a.long_prompt_words = (f"a long prompt runs {_short(pre)} for its prefill, then {_short(dec)} for each "
                               "output token — expected")
    elif fam is not None:
        one, long, name = fam
        served = st.served
        a.dispatch = None  # the shared MLAAttention.forward_impl split is not what this family runs
        if served.get("layers"):
            mine = [lp for lp in served["layers"] if lp.get("platform") == served.get("platform_taken")]
            plats = list(dict.fromkeys(str(lp.get("platform")) for lp in served["layers"]))
            if mine or len(plats) == 1:
                a.family_layer = ", ".join(f"{lp['class']} {lp['ref']}" for lp in (mine or served["layers"])[:3])
            else:  # the host's platform unknown: each platform's layer, never one platform's as the host's
                a.family_layer = "per platform (the host's is not known): " + "; ".join(
                    f"on {words.platform_name(p)}, " + " / ".join(f"{lp['class']} {lp['ref']}"
                                                                  for lp in served["layers"] if lp["platform"] == p)
                    for p in plats)
        a.one_token = f"→ {one.text()} ({name}'s own layer)"
        a.long_prompt = f"{LONG_TOKENS} tokens → {long.text()} ({name}'s own layer)"  # its forward_mha, if any
        a.entry_short, a.entry_long = one.symbol, long.symbol
        a.one_token_words = (f"a 1-token prompt runs {words.route(one.to_dict())} — {name}'s own layer, not the "
                             "shared forward_mha/forward_mqa split")
        a.long_prompt_words = (f"a {LONG_TOKENS}-token prompt runs {words.route(long.to_dict())} — {name}'s own "
                               "layer")
    elif a.model_sparse:
        a.one_token = f"→ {dec} (sparse top-k MQA: a 1-token query is a decode)"
        topk = model.config.get("index_topk")
        if mode == "mha_if_short" and facts is not None:
            r = route(facts, known_from_host(h, facts), LONG_TOKENS)  # what it cannot resolve stays a condition
            a.long_prompt = (f"{LONG_TOKENS} tokens → {r.text()} "
                             f"(index_topk={topk if topk is not None else '?'}; sparse)")
            a.long_prompt_words = (f"a {LONG_TOKENS}-token prompt on this sparse (DSA) model runs "
                                   f"{words.route(r.to_dict())} (index_topk={topk if topk is not None else '?'})")
        else:
            a.long_prompt = f"→ {dec} too: every token takes the sparse top-k MQA path, never {_short(pre)}"
            a.entry_long = dec
            a.long_prompt_words = (f"a long prompt runs {_short(dec)} too: on this sparse (DSA) model every token "
                                   f"takes the sparse top-k route, so {_short(pre)} is never reached — expected")
        a.one_token_words = (f"a 1-token prompt runs {_short(dec)} (the sparse top-k MQA route; a 1-token query is "
                             "a decode), never forward_mha — expected")
    else:
        t = a.threshold or "?"
        a.one_token = f"→ {dec} (decode: 1 token ≤ threshold {t}{thr_of})"
        a.long_prompt = (f"→ {pre} when over {t} token{'' if t == '1' else 's'} (prefill); each output token "
                         f"→ {_short(dec)}")
        whose = f"{a.backend_name}'s threshold" if thr_of else "the threshold"
        a.one_token_words = (f"a 1-token prompt is decode-only (at or below {whose} of {words.tokens(t)}), so it "
                             f"runs {_short(dec)} and {_short(pre)} is never reached; this is expected, not a fault "
                             f"(a print in {_short(pre)} never fires for it)")
        a.long_prompt_words = (f"a prompt over {words.tokens(t)} runs {_short(pre)} for its prefill, then "
                               f"{_short(dec)} for each output token")
    # ---- problems, fail first then warn (the findings' own order within each), each with its action
    order = {"fail": 0, "warn": 1}
    a.problems = sorted((f for f in findings if f.severity in order), key=lambda f: order[f.severity])
    a.info_count = sum(1 for f in findings if f.severity == "info")
    # ---- the routing conditions, resolved (with their source) and not: per prompt sent in a live run, else for a
    # 1-token and a long prompt from what the static audit knows
    routed = [p for p in h.get("prompts") or [] if p.get("routing")]
    if routed:
        a.routes = [_route_line(f"prompt {p.get('name')} ({p.get('prompt_tokens')} tok)", p["routing"]["route"])
                    for p in routed]
    elif facts is not None and cls and not stub:
        host = {"model": h.get("model"), "server": h.get("server"), "log": h.get("log"), "gpu": h.get("gpu"),
                "static": h.get("static")}
        one, long = routes(facts, known_from_host(host, facts), LONG_TOKENS)
        a.routes = [_route_line("1 token", one.to_dict()), _route_line(f"{LONG_TOKENS} tokens", long.to_dict())]
    return a


def answer_of(report: HostReport, kb: Knowledge | None = None) -> HostAnswer | None:
    """The answer of a HostReport as the report stores it (`hosts[].answer`), from the report as it is now (its
    redacted copy: no secret reaches the answer's words)."""
    return host_answer(report.redacted(), kb)


def fill_answers(doc: dict[str, Any], kb: Knowledge | None = None) -> dict[str, Any]:
    """A saved report (JSON) from before the answer was stored: each host without one gets it, read from the
    host's own sections. A host that has one keeps it (it was computed where the report was built)."""
    kb = kb or load_knowledge()
    for h in doc.get("hosts") or []:
        if isinstance(h, dict) and "answer" not in h:
            got = host_answer(h, kb)
            h["answer"] = got.to_dict() if got is not None else None
    return doc
