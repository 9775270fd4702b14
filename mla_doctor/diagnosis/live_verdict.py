"""The live verdict: which MLA path ran for each prompt, which one should have, and why.

Pure rules over `LiveEvidence` (built by `evidence_build.build_live_evidence`): no SSH, no files, no
printing. Each rule is a small function ``rule_x(ev) -> list[Finding]``; ``verdict(ev)`` runs them
all, most severe first (NOT_RESTORED always leads). Codes are part of the JSON contract: add new ones,
never rename.

Path vocabulary (``observed_path`` / ``expected_path``):
  prefill  "mha"  the prompt's tokens went through the dense MHA entry (forward_mha / _forward_prefill)
           "mqa"  they went through an MQA entry (forward_mqa / _forward_decode / a sparse impl's forward)
           "none" no MLA entry saw them        ("unknown": the evidence cannot tell)
           expected only: "mha|mqa" the route depends on facts the run cannot know (routing.py conditions);
           the probe's observation resolves them (ROUTE_RESOLVED_BY_PROBE)
  decode   "mqa"  generated tokens went through an MQA entry
           "hidden" decode steps happened but replayed a full CUDA graph: the Python entry stayed silent
           "none" no decode step
"""
from __future__ import annotations

import functools
import math
import shlex
from dataclasses import dataclass
from typing import Any

from mla_doctor.diagnosis.evidence import LiveEvidence, PromptObservation, RoleCount
from mla_doctor.diagnosis.knowledge import ReleaseFacts, load_knowledge
from mla_doctor.diagnosis.routing import (CONDITION_NAMES, PREFILL_OF, Resolution, Route, condition_text, consistent,
                                          known_from_live, resolve, route)
from mla_doctor.results import Finding, Severity

INFO, WARN, FAIL = Severity.INFO, Severity.WARN, Severity.FAIL
MHA, MQA, SPARSE = "forward_mha", "forward_mqa", "sparse_forward"
EXPECT_VALUES = {"prefill": ("mha", "mqa", "none"), "decode": ("mqa", "hidden", "none")}
EAGER_ACTION = ("restart with --enforce-eager, or keep torch.compile with -cc '{\"cudagraph_mode\":\"PIECEWISE\"}' "
                "(--compilation-config), or read the metadata builder records, which run every step")
# files whose local edits can change which MLA path runs
ROUTING_FILES = ("mla_attention.py", "sparse_mla_attention.py", "attention/backends/mla/", "attention/layer.py",
                 "attention/backends/utils.py", "models/deepseek_v2.py", "models/deepseek_v32/", "platforms/",
                 "layers/mla.py", "models/config.py", "triton_mla.py", "flashmla.py")

__all__ = ["verdict", "expected_path", "observed_path", "parse_expect", "RULES", "EXPECT_VALUES", "route_of",
           "routing_of", "PromptRouting"] + [
    "rule_not_restored", "rule_server_failed", "rule_probe_not_loaded", "rule_probe_loaded_not_called",
    "rule_backends_selected", "rule_mla_not_in_use", "rule_config_log_disagree", "rule_files_modified_live",
    "rule_prefill_mha_observed", "rule_decode_mqa_observed", "rule_short_prompt_decode_only",
    "rule_sparse_all_mqa", "rule_decode_hidden", "rule_path_unexpected", "rule_route_resolved", "rule_expectations",
    "rule_tp_ranks", "rule_drafter_layers", "rule_prompt_problems", "rule_dsa_without_index_topk"]


# --------------------------------------------------------------------------- --expect

def parse_expect(text: str | None) -> dict[str, str]:
    """``"prefill=mha,decode=mqa"`` -> ``{"prefill": "mha", "decode": "mqa"}``; ValueError when malformed."""
    if text is None or not str(text).strip():
        raise ValueError("empty expectation: give KEY=VALUE pairs, e.g. prefill=mha,decode=mqa")
    out: dict[str, str] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in {text!r}: items are KEY=VALUE separated by commas")
        if "=" not in part:
            raise ValueError(f"{part!r} is not KEY=VALUE (e.g. prefill=mha)")
        key, value = (x.strip().lower() for x in part.split("=", 1))
        if key not in EXPECT_VALUES:
            raise ValueError(f"unknown key {key!r}: one of {', '.join(EXPECT_VALUES)}")
        if value not in EXPECT_VALUES[key]:
            raise ValueError(f"{key}={value!r}: {key} is one of {', '.join(EXPECT_VALUES[key])}")
        if key in out:
            raise ValueError(f"{key} given twice in {text!r}")
        out[key] = value
    return out


# --------------------------------------------------------------------------- small helpers

def _vstr(ev: LiveEvidence) -> str:
    return f"vLLM {ev.version or '?'}"


def _engine(ev: LiveEvidence) -> tuple[str | None, str]:
    """The engine from the log; else the only engine the release has. Never the version's default."""
    if ev.engine:
        return ev.engine, "from the log"
    if len(ev.possible_engines) == 1:
        return ev.possible_engines[0], f"the only engine {_vstr(ev)} has"
    return None, "not in the log (no 'Initializing a V0/V1 LLM engine' line)"


def _sparse(ev: LiveEvidence) -> bool | None:
    """Sparse as the server ran it: the log wins over config.json."""
    if ev.log_is_sparse is not None:
        return ev.log_is_sparse
    return ev.config_is_sparse


def _layers(prompt: PromptObservation) -> int:
    seen: set[str] = set()
    for rc in prompt.calls.values():
        seen.update(rc.calls_per_layer)
    return len(seen) or 1


def _ranks(prompt: PromptObservation) -> int:
    """Every tensor-parallel rank runs every layer: counts summed over ranks are divided by this."""
    return max(1, len([r for r in prompt.per_rank if r != "?"]))


def _live_steps(rc: RoleCount, layers: int, ranks: int = 1) -> int:
    """Steps = calls per layer (per rank), not counting calls made during CUDA-graph capture."""
    live = rc.calls - rc.capturing
    if live <= 0:
        return 0
    per = len(rc.calls_per_layer) if rc.calls_per_layer else layers
    return math.ceil(live / max(1, per) / max(1, ranks))


def _tokens_per_layer(rc: RoleCount, ranks: int = 1) -> int | None:
    if rc.tokens_per_layer:
        return max(rc.tokens_per_layer.values()) // max(1, ranks)
    return rc.tokens // max(1, ranks) if rc.calls and not rc.unknown_tokens else None


def _one_rank(steps: list[dict]) -> list[dict]:
    ranks = sorted({s.get("tp_rank") for s in steps if s.get("tp_rank") is not None})
    return [s for s in steps if s.get("tp_rank") in (None, ranks[0])] if ranks else list(steps)


def _is_decode_step(s: dict) -> bool:
    return (s.get("num_decode_tokens") or 0) > 0 or (s.get("num_decodes") or 0) > 0


def _is_prefill_step(s: dict) -> bool:
    return (s.get("num_prefill_tokens") or 0) > 0 or (s.get("num_prefills") or 0) > 0


def _builder(prompt: PromptObservation) -> dict[str, int]:
    steps = _one_rank(prompt.builder)
    return {"steps": len(steps), "decode_steps": sum(1 for s in steps if _is_decode_step(s)),
            "prefill_steps": sum(1 for s in steps if _is_prefill_step(s))}


def _where(rc: RoleCount) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(rc.classes.items())) if rc.classes else ""


def _count_text(key: str, rc: RoleCount, layers: int, ranks: int = 1) -> str:
    per = _tokens_per_layer(rc, ranks)
    steps = _live_steps(rc, layers, ranks)
    txt = f"{key}: {rc.calls} call(s) over {len(rc.calls_per_layer) or '?'} layer(s), {steps} step(s)"
    if ranks > 1:
        txt += f" on each of {ranks} TP ranks"
    if per is not None:
        txt += f", {per} token(s) per layer"
    if rc.unknown_tokens:
        txt += f", {rc.unknown_tokens} call(s) with unreadable token counts"
    if rc.capturing:
        txt += f", {rc.capturing} during CUDA-graph capture"
    if rc.classes:
        txt += f" [{_where(rc)}]"
    return txt


def _prompt_label(p: PromptObservation) -> str:
    cfg = f", {p.configuration}" if p.configuration and p.configuration != "production" else ""
    return f"prompt {p.name!r} ({p.prompt_tokens} token(s), max_tokens {p.max_tokens}{cfg})"


def _backend_text(ev: LiveEvidence) -> str:
    return ev.decode_backend or "the (unlogged) backend"


def _threshold_text(ev: LiveEvidence) -> str:
    if ev.decode_threshold is None:
        return "reorder_batch_threshold unknown (no backend line in the log)"
    txt = f"{_backend_text(ev)} reorder_batch_threshold = {ev.decode_threshold}"
    if ev.decode_threshold_ref:
        txt += f" ({ev.decode_threshold_ref})"
    return txt


# --------------------------------------------------------------------------- paths

def observed_path(prompt: PromptObservation) -> dict[str, Any]:
    """What the probe saw for one prompt."""
    layers, ranks = _layers(prompt), _ranks(prompt)
    mha, mqa, sp = prompt.count(MHA), prompt.count(MQA), prompt.count(SPARSE)
    mha_steps, mqa_steps, sp_steps = (_live_steps(rc, layers, ranks) for rc in (mha, mqa, sp))
    b = _builder(prompt)
    out: dict[str, Any] = {"mha_steps": mha_steps, "mqa_steps": mqa_steps, "sparse_steps": sp_steps,
                           "mha_tokens_per_layer": _tokens_per_layer(mha, ranks) if mha.calls else 0,
                           "mqa_tokens_per_layer": _tokens_per_layer(mqa, ranks) if mqa.calls else 0,
                           "sparse_tokens_per_layer": _tokens_per_layer(sp, ranks) if sp.calls else 0,
                           "layers": layers, "ranks": ranks, "builder_steps": b["steps"],
                           "builder_decode_steps": b["decode_steps"]}
    why = []
    if mha_steps:
        prefill, mqa_for_prefill = "mha", 0
        # the prefill role's entry: forward_mha, or a model-private family's own prefill (Kimi K3's fused one)
        names = sorted({w.rsplit(".", 1)[-1] for w in mha.classes}) or ["forward_mha"]
        entry = "/".join(names) if names != ["forward_mha"] else "forward_mha"
        if entry != "forward_mha":
            entry = "the prefill entry " + "/".join(sorted(mha.classes))
        why.append(f"{entry} ran {mha_steps} step(s), {out['mha_tokens_per_layer']} token(s) per layer")
    elif sp_steps:
        prefill, mqa_for_prefill = "mqa", 0
        why.append(f"the sparse impl's own forward ran {sp_steps} step(s) (top-k MQA for every token), "
                   f"{out['sparse_tokens_per_layer']} token(s) per layer; no MHA entry ran")
    elif mqa_steps:
        prefill, mqa_for_prefill = "mqa", 1
        why.append(f"no forward_mha call: the prompt's {prompt.prompt_tokens} token(s) went through forward_mqa "
                   f"({mqa_steps} step(s), {out['mqa_tokens_per_layer']} token(s) per layer)")
    else:
        prefill, mqa_for_prefill = "none", 0
        why.append("no MLA entry (forward_mha / forward_mqa / sparse forward) ran for this prompt")
    dec_seen = (sp_steps - 1) if sp_steps else max(0, mqa_steps - mqa_for_prefill)
    generated = prompt.completion_tokens
    steps = _one_rank(prompt.builder)
    first_is_decode = bool(steps) and _is_decode_step(steps[0]) and not _is_prefill_step(steps[0])
    builder_dec = b["decode_steps"] - (1 if first_is_decode else 0)  # the prompt's own step, if decode-classified
    capture_only = bool(mqa.calls) and mqa.capturing == mqa.calls
    if dec_seen > 0:
        decode = "mqa"
        why.append(f"{dec_seen} decode step(s) through {'the sparse forward' if sp_steps else 'forward_mqa'}")
    elif builder_dec > 0 or capture_only or ((generated or 0) > 1 and prefill != "none"):
        decode = "hidden"
        bits = []
        if builder_dec > 0:
            bits.append(f"the metadata builder classified {builder_dec} later step(s) as decode")
        if (generated or 0) > 1:
            bits.append(f"{generated} token(s) were generated")
        if capture_only:
            bits.append("forward_mqa ran only while a CUDA graph was being captured")
        why.append("decode steps happened (" + "; ".join(bits) + ") but no MQA entry ran for them")
    else:
        decode = "none"
        why.append("no decode step" + (" (max_tokens 1)" if prompt.max_tokens <= 1 else " was observed"))
    if prefill == "none" and first_is_decode:
        why.append("the builder classified the prompt's own step as decode (its MQA call was not seen)")
    out.update(prefill=prefill, decode=decode, why="; ".join(why))
    return out


@functools.lru_cache(maxsize=16)
def _facts(version: str | None) -> ReleaseFacts:
    return load_knowledge().for_version(version)


def route_of(ev: LiveEvidence, prompt: PromptObservation) -> Route:
    """This prompt's path by the routing knowledge (routing.py, the same logic as static and explain), with what
    the run knows; what it does not know stays a condition."""
    facts = _facts(ev.version)
    return route(facts, known_from_live(ev, facts), prompt.prompt_tokens, prompt.name)


@dataclass
class PromptRouting:
    """One prompt's route (conditional or not) and, when conditional, what the probe's observation resolved."""
    prompt: str
    tokens: int
    route: Route
    resolution: Resolution | None = None

    @property
    def conditional(self) -> bool:
        return self.route.path is None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "tokens": self.tokens, "conditional": self.conditional,
                "route": self.route.to_dict(),
                "resolution": self.resolution.to_dict() if self.resolution is not None else None}


def routing_of(ev: LiveEvidence, prompt: PromptObservation) -> PromptRouting:
    r = route_of(ev, prompt)
    res = resolve(r, observed_path(prompt)["prefill"]) if ev.armed else None
    return PromptRouting(prompt=prompt.name, tokens=prompt.prompt_tokens, route=r, resolution=res)


def expected_path(ev: LiveEvidence, prompt: PromptObservation) -> dict[str, Any]:
    """What this release, engine, backend and threshold should do with this prompt, and why. The prefill comes
    from ``route_of``; a route that depends on unknown facts gives ``"mha|mqa"`` and says on what."""
    engine, engine_src = _engine(ev)
    sparse = _sparse(ev)
    thr = ev.decode_threshold
    n = prompt.prompt_tokens
    out: dict[str, Any] = {"engine": engine, "threshold": thr, "sparse": bool(sparse), "prefill_hidden": False,
                           "backend": ev.decode_backend}
    decode_wanted = prompt.max_tokens > 1

    def done(prefill: str, decode: str, why: list[str]) -> dict[str, Any]:
        out.update(prefill=prefill, decode=decode, why="; ".join(why))
        return out

    def decode_path(why: list[str]) -> str:
        if not decode_wanted:
            return "none"
        if ev.full_cudagraph_decode:
            why.append(f"decode steps replay a full CUDA graph ({ev.cudagraph_mode or 'default mode'}, "
                       f"{_backend_text(ev)} CG support {ev.backend_cudagraph_support or 'V0 full capture'}): "
                       "the MQA entry's Python does not run per step")
            return "hidden"
        if ev.full_cudagraph_decode is None:
            why.append("whether decode replays a full CUDA graph is unknown (backend or mode not in the log)")
            return "unknown"
        if ev.breakable_cudagraph:
            why.append("breakable CUDA graph: the sparse attention call runs eagerly on replay")
        return "mqa"

    if ev.decode_backend_is_mla is False:
        return done("none", "none", [f"the log shows a non-MLA backend ({ev.decode_backend}): no MLA entry runs"])
    if ev.config_is_mla is False and not ev.decode_backend_is_mla:
        return done("none", "none", [f"the model is not MLA in {_vstr(ev)}: {ev.model_reason}"])
    why: list[str] = [f"engine {engine} ({engine_src})" if engine else f"engine {engine_src}"]
    r = route_of(ev, prompt)
    routed_sparse = sparse and ev.sparse_mode and ev.sparse_mode != "none"
    if routed_sparse:
        src = "the log" if ev.log_is_sparse else "config.json (index_topk; the log does not say)"
        why.append(f"sparse (DSA) per {src}")
    if r.path is None:  # conditional: every branch with its condition, never a guess
        why.append(f"{r.text()} — {r.why()}")
        why.append("not known to the run: " + ", ".join(CONDITION_NAMES.get(u, u) for u in r.unresolved)
                   + "; the probe's observation resolves it")
        paths = {PREFILL_OF[b.path] for b in r.branches}
        return done("|".join(x for x in ("mha", "mqa", "none") if x in paths), decode_path(why), why)
    prefill = PREFILL_OF[r.path]
    if routed_sparse or prefill == "none":
        why.append(r.why())
    elif engine == "V0":
        why.append("V0 splits by request phase: a prompt is prefill (dense MHA) whatever its length, "
                   "even 1 token")
    elif prefill == "mqa":
        why.append(f"V1: {n} new token(s) <= {_threshold_text(ev)}: the prompt is decode-classified and runs "
                   "forward_mqa, never forward_mha")
        uniform = 1 + int(ev.num_speculative_tokens or 0)
        if ev.full_cudagraph_decode and n == uniform:
            out["prefill_hidden"] = True
            why.append(f"a lone {n}-token query is a uniform decode batch: it replays the full CUDA graph, "
                       "so forward_mqa stays silent for it too")
    elif thr is None:
        why.append(("V1: " if engine == "V1" else "") + r.why())
    elif engine is None:
        why.append(f"{n} token(s) > {_threshold_text(ev)}: prefill (MHA) under V0 and V1 alike")
    else:
        why.append(f"V1: {n} new token(s) > {_threshold_text(ev)}: prefill through forward_mha")
    return done(prefill, decode_path(why), why)


def _compatible(expected: dict[str, Any], observed: dict[str, Any], key: str) -> bool:
    e, o = expected[key], observed[key]
    if e == "unknown":
        return True
    if key == "prefill" and expected.get("prefill_hidden"):
        return o in ("none", e)
    if key == "decode" and e == "hidden":
        return o in ("hidden", "none")
    return o in e.split("|")  # a conditional route: any of its branches


# --------------------------------------------------------------------------- rules

def rule_not_restored(ev: LiveEvidence) -> list[Finding]:
    if ev.restored is not False:
        return []
    return [Finding("NOT_RESTORED", FAIL,
                    "the host was NOT restored after the run: instrumentation is still in place "
                    f"({ev.method} method), and the server may still run instrumented code",
                    [ev.restore_detail or "restore reported failure"],
                    "run `mla-doctor revert HOST` now (it restores byte-for-byte and never clobbers later edits); "
                    "if that fails, reinstall vLLM with pip install --force-reinstall --no-deps")]


def rule_server_failed(ev: LiveEvidence) -> list[Finding]:
    if ev.server_started:
        return []
    evid = [f"start error: {ev.start_error}"] if ev.start_error else []
    evid += [f"log: {ln}" for ln in ev.fatal_lines[:10]]
    if ev.model_startup_failure:
        evid.append(f"model config: {ev.model_startup_failure}")
    action = "read the server log around the quoted lines and fix the cause before re-running"
    if ev.model_startup_failure:
        action = "fix config.json (e.g. restore index_topk) or the architecture; then re-run"
    return [Finding("SERVER_FAILED_TO_START", FAIL,
                    f"the vLLM server did not start ({ev.configuration} configuration): no path can be observed",
                    evid, action)]


def _armed_processes(ev: LiveEvidence) -> list[str]:
    return sorted({f"{r.get('process') or r.get('comm') or '?'} pid={r.get('pid', '?')}" for r in ev.armed})


def rule_probe_not_loaded(ev: LiveEvidence) -> list[Finding]:
    if ev.armed or not ev.server_started:
        return []
    s = ev.settings
    evid = ["no 'armed' record from any process: the probe module was never imported"]
    likely = []
    if s.get("restarted") is False:
        likely.append("the server was not restarted after instrumenting, so it still runs the old code")
    if s.get("container") or s.get("mapped_vllm_dirs"):
        likely.append("the server runs in a container: its vLLM is not the one on the host that was instrumented"
                      + (f" (mapped: {s.get('mapped_vllm_dirs')})" if s.get("mapped_vllm_dirs") else ""))
    srv, ins = s.get("server_python"), s.get("instrumented_python") or s.get("python")
    if srv and ins and srv != ins:
        likely.append(f"the server runs {srv}, but {ins} was instrumented (another environment)")
    if ev.method == "plugin":
        if s.get("vllm_plugins") is not None:
            likely.append(f"VLLM_PLUGINS={s.get('vllm_plugins')!r} in the server's environment excludes the probe "
                          "plugin")
        likely.append("plugin method: the entry point must be visible to the server's interpreter "
                      "(same environment, restarted)")
    else:
        likely.append("patch method: the server must import the patched files, i.e. be restarted from the "
                      "instrumented environment")
    evid += [f"likely: {x}" for x in likely]
    if ev.prompts:
        evid.append(f"{len(ev.prompts)} prompt(s) were sent while the probe was absent")
    return [Finding("PROBE_NOT_LOADED", FAIL, "the probe never loaded in any server process: no path was "
                    "observed (" + likely[0] + ")", evid,
                    "restart the server from the instrumented interpreter (check `which python` of the unit / "
                    "container), then re-run; `mla-doctor static` shows which interpreter the server uses")]


def _any_call(ev: LiveEvidence) -> bool:
    return any(p.calls or p.builder or p.dispatch or p.drafter_calls for p in ev.prompts)


def rule_probe_loaded_not_called(ev: LiveEvidence) -> list[Finding]:
    if not ev.armed or not ev.prompts or _any_call(ev):
        return []
    procs = _armed_processes(ev)
    engine_side = [p for p in procs if any(k in p for k in ("EngineCore", "Worker", "VllmWorker"))]
    evid = [f"armed in: {', '.join(procs)}"]
    evid.append(f"{len(ev.prompts)} prompt(s) answered, 0 calls of any instrumented entry, builder or dispatch")
    if not engine_side:
        evid.append("no engine-side process (EngineCore / Worker) armed: the model may run in a process that "
                    "did not import the instrumented code")
    non_mla = ev.decode_backend_is_mla is False or ev.config_is_mla is False
    return [Finding("PROBE_LOADED_NOT_CALLED", WARN if non_mla else FAIL,
                    "the probe loaded but no instrumented MLA function ran for any prompt"
                    + (" (the model does not run MLA: see MLA_NOT_IN_USE)" if non_mla else ""),
                    evid, "check that the served model uses MLA and that the instrumented files are the ones the "
                          "server imports")]


def rule_backends_selected(ev: LiveEvidence) -> list[Finding]:
    if not ev.backend_lines and not ev.engine_line:
        if not ev.server_started:
            return []  # SERVER_FAILED_TO_START quotes the log
        if not ev.log_found:
            return [Finding("BACKENDS_SELECTED", INFO, "no server log: backends and engine are unknown",
                            [], "pass the server log so the verdict can read the backend and engine")]
        return [Finding("BACKENDS_SELECTED", INFO, "the server log names no attention backend (INFO level?)",
                        [], "keep VLLM_LOGGING_LEVEL at INFO or lower")]
    evid = [f"log: {ln}" for ln in ev.backend_lines]
    if ev.engine_line:
        evid.append(f"engine {ev.engine}: {ev.engine_line[:240]}")
    evid.append(f"cudagraph_mode={ev.cudagraph_mode} eager={ev.eager}")
    evid += [f"log: {ln}" for ln in ev.cudagraph_lines[:3]]
    if ev.decode_threshold is not None:
        evid.append(_threshold_text(ev) + (f" [{ev.decode_threshold_note}]" if ev.decode_threshold_note else ""))
    if ev.gpu:
        evid.append(f"GPU: {ev.gpu} (compute capability {ev.compute_capability})")
    for k in ("backend_decode", "prefill", "dispatch"):
        if ev.entry_refs.get(k):
            evid.append(f"{k}: {ev.entry_refs[k]}")
    dec = ev.decode_backend or "?"
    pre = ev.prefill_backend or "not logged"
    return [Finding("BACKENDS_SELECTED", INFO, f"decode (MQA) backend {dec}, MLA prefill kernel {pre}, "
                    f"engine {ev.engine or 'not logged'}", evid)]


def rule_mla_not_in_use(ev: LiveEvidence) -> list[Finding]:
    if ev.config_is_mla is False:
        return []
    if ev.decode_backend_is_mla is False:
        return [Finding("MLA_NOT_IN_USE", WARN,
                        f"the model is MLA ({ev.model_type}) but the server selected a non-MLA backend "
                        f"({ev.decode_backend}): attention runs dense MHA on decompressed K/V",
                        [f"log: {ln}" for ln in ev.backend_lines[:3]] + [f"config: {ev.model_reason}"],
                        "check VLLM_MLA_DISABLE in the server's environment (vLLM logs nothing about it)")]
    if ev.config_is_mla and ev.armed and ev.prompts and not _any_call(ev):
        return [Finding("MLA_NOT_IN_USE", WARN,
                        f"the model is MLA ({ev.model_type}) but no MLA entry, dispatch or builder ran for any "
                        "prompt", [f"armed in: {', '.join(_armed_processes(ev))}"],
                        "check VLLM_MLA_DISABLE and the backend line in the server log")]
    return []


def rule_config_log_disagree(ev: LiveEvidence) -> list[Finding]:
    if ev.config_is_sparse is None or ev.log_is_sparse is None or ev.config_is_sparse == ev.log_is_sparse:
        return []
    ran = []
    for p in ev.prompts:
        for key in (MQA, MHA, SPARSE):
            if p.count(key).classes:
                ran.append(f"{_prompt_label(p)} ran {_where(p.count(key))}")
    if ev.config_is_sparse and not ev.log_is_sparse:
        summary = (f"config.json makes this a sparse (DSA) model in {_vstr(ev)} (index_topk="
                   f"{ev.index_topk}), but the log shows the dense {ev.decode_backend} backend and no sparse/indexer "
                   "line: the model ran DENSE MLA. Something between config.json and vLLM (a custom loader, a GGUF "
                   "conversion, --hf-config-path) removed index_topk from the config in memory. The log wins.")
        action = ("if sparse attention was intended, find what strips index_topk before vLLM reads the config "
                  "(the `hasattr(config, \"index_topk\")` gate decides); vLLM itself never deletes it")
    else:
        summary = (f"config.json has no index_topk (dense in {_vstr(ev)}), but the log shows sparse attention "
                   f"({ev.decode_backend}): the server loaded a different config than the one read. The log wins.")
        action = "check --hf-config-path and which model directory the server really loaded"
    evid = [f"config.json: model_type={ev.model_type} architecture={ev.architecture} index_topk={ev.index_topk}",
            f"config says: {ev.model_reason}"]
    evid += [f"log: {ln}" for ln in ev.backend_lines[:3]]
    evid += [f"log sparse line: {ln}" for ln in ev.sparse_lines[:3]] or ["log: no sparse / indexer line"]
    evid += ran[:4]
    return [Finding("CONFIG_LOG_DISAGREE", WARN, summary, evid, action)]


def rule_dsa_without_index_topk(ev: LiveEvidence) -> list[Finding]:
    dsa = ev.model_type in ("deepseek_v32", "glm_moe_dsa") or ev.architecture in (
        "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
    if not dsa or not ev.config_is_mla or ev.config_is_sparse or ev.model_startup_failure:
        return []
    return [Finding("DSA_WITHOUT_INDEX_TOPK", INFO,
                    f"{ev.architecture or ev.model_type} without index_topk in config.json runs as dense MLA "
                    f"in {_vstr(ev)} (no indexer, normal MHA/MQA split)",
                    [f"config: {ev.model_reason}"],
                    "GGUF conversions and 'dense attention' exports drop the indexer; use the original config "
                    "if sparse attention is wanted")]


def rule_files_modified_live(ev: LiveEvidence) -> list[Finding]:
    if not ev.modified_files:
        return []
    routing = [f for f in ev.modified_files if any(k in f for k in ROUTING_FILES)]
    sev = FAIL if routing else WARN
    summary = (f"{len(ev.modified_files)} installed vLLM file(s) had local modifications during the run: "
               "the paths observed are those of the edited code, not of stock vLLM")
    if routing:
        summary += f"; {len(routing)} of them decide MLA routing"
    return [Finding("VLLM_FILES_MODIFIED_LIVE", sev, summary,
                    [f"modified: {f}" for f in ev.modified_files[:30]],
                    "diff them against the release wheel and restore them "
                    "(pip install --force-reinstall --no-deps "
                    f"{shlex.quote('vllm==' + (ev.version or 'VERSION'))}), then re-run")]


def rule_prefill_mha_observed(ev: LiveEvidence) -> list[Finding]:
    out = []
    for p in ev.prompts:
        rc = p.count(MHA)
        if not rc.calls:
            continue
        layers = _layers(p)
        evid = [_count_text(MHA, rc, layers, _ranks(p))]
        if ev.entry_refs.get("prefill"):
            evid.append(f"entry: {ev.entry_refs['prefill']}")
        if p.dispatch:
            d = _one_rank(p.dispatch)[0]
            evid.append("dispatch, first step: " + ", ".join(f"{k}={v}" for k, v in d.items() if k != "tp_rank"))
        engine, _ = _engine(ev)
        note = (" (V0: a prompt is prefill whatever its length)" if engine == "V0" else "")
        out.append(Finding("PREFILL_MHA_OBSERVED", INFO,
                           f"{_prompt_label(p)}: prefill ran the dense MHA entry{note}", evid))
    return out


def rule_decode_mqa_observed(ev: LiveEvidence) -> list[Finding]:
    out = []
    for p in ev.prompts:
        rc = p.count(MQA)
        if not rc.calls or rc.calls == rc.capturing:
            continue
        obs = observed_path(p)
        evid = [_count_text(MQA, rc, _layers(p), _ranks(p))]
        if ev.entry_refs.get("backend_decode"):
            evid.append(f"entry: {ev.entry_refs['backend_decode']}")
        evid.append(f"observed: prefill={obs['prefill']} decode={obs['decode']} ({obs['why']})")
        own = "the prompt's own tokens" + (" (sparse: all tokens go to MQA)" if _sparse(ev) else
                                           " (decode-classified: <= the decode threshold)")
        what = (own + " and the decode steps" if obs["prefill"] == "mqa" and obs["decode"] == "mqa" else
                own if obs["prefill"] == "mqa" else "the decode steps")
        out.append(Finding("DECODE_MQA_OBSERVED", INFO, f"{_prompt_label(p)}: the MQA entry ran for {what}", evid))
    return out


def rule_short_prompt_decode_only(ev: LiveEvidence) -> list[Finding]:
    if not ev.armed:
        return []  # nothing was observed: PROBE_NOT_LOADED says why
    engine, _ = _engine(ev)
    if engine != "V1" or _sparse(ev):
        return []
    thr = ev.decode_threshold if ev.decode_threshold is not None else 1
    any_mha = any(p.count(MHA).calls for p in ev.prompts)
    out = []
    for p in ev.prompts:
        if p.prompt_tokens > thr or p.count(MHA).calls:
            continue
        obs = observed_path(p)
        if obs["prefill"] == "none" and not p.builder:
            continue  # nothing ran at all: other rules explain it
        src = "" if ev.decode_threshold is not None else " (backend not logged: every V1 backend has >= 1)"
        evid = [f"{p.prompt_tokens} new token(s) <= {_threshold_text(ev)}{src}",
                f"split: {ev.entry_refs.get('split', 'split_decodes_and_prefills')} puts queries <= threshold first "
                "and sends them to the MQA entry",
                f"observed: prefill={obs['prefill']} decode={obs['decode']} ({obs['why']})"]
        if ev.decode_threshold_note:
            evid.append(f"threshold note: {ev.decode_threshold_note}")
        if p.builder:
            b = _one_rank(p.builder)[0]
            evid.append("builder, first step: " + ", ".join(f"{k}={v}" for k, v in b.items() if k != "tp_rank"))
        if any_mha:
            longer = [q.name for q in ev.prompts if q.count(MHA).calls]
            evid.append(f"forward_mha did run for longer prompt(s): {', '.join(longer)}")
        summary = (f"{_prompt_label(p)} was decode-only: in V1 a query of <= {thr} new token(s) with "
                   f"{_backend_text(ev)} is classified decode, so forward_mha is never reached. This is expected, "
                   "not a fault")
        if not any_mha:
            summary += "; no prompt of this run reached prefill, so the run says nothing about forward_mha"
        out.append(Finding("SHORT_PROMPT_DECODE_ONLY", INFO if any_mha else WARN, summary, evid,
                           f"send a prompt longer than {thr} new tokens (unique, to dodge the prefix cache) "
                           "to see forward_mha"))
    return out


def rule_sparse_all_mqa(ev: LiveEvidence) -> list[Finding]:
    if not ev.armed:
        return []  # nothing was observed: PROBE_NOT_LOADED says why
    if not _sparse(ev) or not ev.sparse_mode or ev.sparse_mode == "none":
        return []
    out = []
    for p in ev.prompts:
        obs = observed_path(p)
        if obs["prefill"] != "mqa":
            continue
        exp = expected_path(ev, p)
        if ev.family:  # a model-private family's own layer: its route (FAMILY_* in `why`), not the shared split's
            if exp["prefill"] == "mqa":
                out.append(Finding("SPARSE_ALL_MQA", INFO,
                                   f"{_prompt_label(p)}: {ev.family.get('family')}'s own layer sent every token "
                                   "through its forward_mqa, as its code says (it has no forward_mha)",
                                   [_count_text(MQA, p.count(MQA), _layers(p), _ranks(p)), f"expected: {exp['why']}"],
                                   "expected behaviour of this model family"))
            continue
        key = SPARSE if p.count(SPARSE).calls else MQA
        evid = [_count_text(key, p.count(key), _layers(p), _ranks(p)), f"release routing: {ev.sparse_routing}"]
        evid += [f"log: {ln}" for ln in (ev.backend_lines[:1] + ev.sparse_lines[:2])]
        if ev.sparse_mode == "own_forward":
            summary = (f"{_prompt_label(p)}: {_vstr(ev)} sparse (DSA) impl ran its own forward for ALL tokens "
                       "(top-k sparse MQA kernel, prefill included); _forward_prefill/_forward_decode never run")
        elif ev.sparse_mode == "all_mqa":
            summary = (f"{_prompt_label(p)}: in {_vstr(ev)} a sparse (DSA) impl sends ALL tokens to forward_mqa, "
                       "prefill included (num_mha_tokens = 0): no forward_mha is expected")
        else:
            if exp["prefill"] != "mqa":
                continue
            why_short = (f"<= decode threshold {ev.decode_threshold}" if ev.decode_threshold is not None
                         and p.prompt_tokens <= ev.decode_threshold else
                         f"> index_topk {ev.index_topk}" if ev.index_topk is not None
                         and p.prompt_tokens > ev.index_topk else "forced top-k MQA")
            summary = (f"{_prompt_label(p)}: in {_vstr(ev)} sparse prefill uses dense forward_mha only while the "
                       f"sequence length <= index_topk ({ev.index_topk}); this prompt ({why_short}) went all "
                       "through the top-k forward_mqa")
            evid.append(f"expected: {exp['why']}")
        out.append(Finding("SPARSE_ALL_MQA", INFO, summary, evid,
                           "expected behaviour of sparse MLA; on 0.26+ a prompt <= index_topk shows forward_mha"
                           if ev.sparse_mode == "mha_if_short" else "expected behaviour of sparse MLA in this release"))
    return out


def rule_decode_hidden(ev: LiveEvidence) -> list[Finding]:
    if not ev.armed:
        return []  # nothing was observed: PROBE_NOT_LOADED says why
    out = []
    for p in ev.prompts:
        obs = observed_path(p)
        if obs["decode"] != "hidden":
            continue
        evid = [obs["why"]]
        startup = ev.startup_calls.get(MQA) or ev.startup_calls.get(SPARSE)
        if startup and startup.calls:
            evid.append(f"at startup the MQA entry ran {startup.calls} time(s), {startup.capturing} while capturing "
                        "CUDA graphs: that is the only time its Python runs for pure-decode batches")
        if p.builder:
            evid.append("builder steps: " + "; ".join(
                ", ".join(f"{k}={v}" for k, v in s.items() if k != "tp_rank") for s in _one_rank(p.builder)[:6]))
        evid.append(f"cudagraph_mode={ev.cudagraph_mode or '(release default)'}, {_backend_text(ev)} CUDA-graph "
                    f"support {ev.backend_cudagraph_support or '?'}, eager={ev.eager}")
        evid += [f"log: {ln}" for ln in ev.cudagraph_lines[:2]]
        out.append(Finding("DECODE_HIDDEN_BY_CUDA_GRAPHS", WARN,
                           f"{_prompt_label(p)}: decode steps ran (builder/usage show them) but forward_mqa stayed "
                           "silent: pure-decode batches replay a full CUDA graph that contains attention, so the "
                           "MQA entry's Python runs only at capture", evid, EAGER_ACTION))
    return out


def rule_path_unexpected(ev: LiveEvidence) -> list[Finding]:
    if not ev.armed:
        return []  # nothing was observed: PROBE_NOT_LOADED says why
    out = []
    for p in ev.prompts:
        obs = observed_path(p)
        if obs["prefill"] == "none" and obs["decode"] == "none" and not p.builder:
            continue  # nothing observed: PROBE_* rules explain it
        if p.foreign_traffic:
            continue  # other clients' calls are in these counts: FOREIGN_TRAFFIC says so, no path is claimed
        exp = expected_path(ev, p)
        bad = [k for k in ("prefill", "decode") if not _compatible(exp, obs, k)]
        if not bad:
            continue
        evid = [f"expected: {exp['why']}", f"observed: {obs['why']}"]
        summary = (f"{_prompt_label(p)}: observed " + ", ".join(f"{k}={obs[k]}" for k in bad)
                   + " but this release/backend should give " + ", ".join(f"{k}={exp[k]}" for k in bad))
        if "prefill" in bad and obs["prefill"] in ("mha", "mqa"):
            r = route_of(ev, p)
            summary += ("; no branch of the routing knowledge allows it: the knowledge is wrong or incomplete "
                        "for this host")
            evid.append(f"routing: {r.text()} ({r.why()})")
            if r.resolved:
                evid.append("known: " + ", ".join(f"{k}={v}" for k, v in r.resolved.items()))
        out.append(Finding("PATH_UNEXPECTED", WARN, summary, evid,
                           "a prefix-cache hit, chunked prefill, a local edit or a knowledge gap can explain it; "
                           "re-run with a unique prompt and check VLLM_FILES_MODIFIED"))
    return out


def rule_route_resolved(ev: LiveEvidence) -> list[Finding]:
    """A conditional route (facts the run could not know) resolved by which entry the probe saw run."""
    if not ev.armed:
        return []  # nothing was observed: PROBE_NOT_LOADED says why
    out, pairs = [], []
    for p in ev.prompts:
        pr = routing_of(ev, p)
        res = pr.resolution
        if res is None or not res.matched:
            continue  # unconditional, nothing observed, or no branch fits (PATH_UNEXPECTED says so)
        pairs.append((pr.route, res.observed))
        evid = [f"routing: {pr.route.text()}"] + [f"[{b.when}] {b.why}" for b in pr.route.branches]
        evid.append(f"observed: {observed_path(p)['why']}")
        evid.append("unknown to the run: " + ", ".join(CONDITION_NAMES.get(u, u) for u in pr.route.unresolved))
        out.append(Finding("ROUTE_RESOLVED_BY_PROBE", INFO, f"{_prompt_label(p)}: {res.text}", evid))
    if not pairs:
        return out
    together = consistent(pairs)
    if together is None:
        out.append(Finding("ROUTE_CONDITIONS_CONTRADICT", WARN,
                           "each prompt's path fits a branch of the routing, but no one set of facts (GPU, KV dtype, "
                           "FlashAttention version, TP, ...) fits them all: the knowledge is wrong or incomplete "
                           "for this host", [f.summary for f in out],
                           "a prefix-cache hit or a local edit can explain it; else report the run (mla-doctor "
                           "--json) with the vLLM version"))
    elif together:
        line = "all prompts together: " + ", ".join(condition_text(k, v) for k, v in together.items())
        for f in out:
            f.evidence.append(line)
    return out


def rule_expectations(ev: LiveEvidence) -> list[Finding]:
    """--expect KEY=VALUE holds when at least one prompt of the run observed it (each prompt is listed)."""
    if not ev.expectations or not ev.prompts:
        return []
    if not ev.armed:
        return [Finding("EXPECTATION_UNMET", FAIL, f"expectation {key}={want} could not be checked: the probe "
                        "never loaded", [], "see PROBE_NOT_LOADED") for key, want in ev.expectations.items()]
    out = []
    paths = [(p, observed_path(p)) for p in ev.prompts]
    for key, want in ev.expectations.items():
        seen = [(p, o) for p, o in paths if o.get(key) == want]
        evid = [f"{_prompt_label(p)}: {key}={o.get(key)} ({o['why']})" for p, o in paths]
        if seen:
            out.append(Finding("EXPECTATION_MET", INFO, f"expectation {key}={want} met by "
                               + ", ".join(repr(p.name) for p, _ in seen), evid))
            continue
        hints = [f"{_prompt_label(p)} expected {key}={expected_path(ev, p).get(key)}: {expected_path(ev, p)['why']}"
                 for p, _ in paths]
        action = "see why each prompt took its path; "
        if key == "decode" and want == "mqa" and any(o["decode"] == "hidden" for _, o in paths):
            action += EAGER_ACTION
        elif key == "prefill" and want == "mha":
            action += f"send a prompt longer than the decode threshold ({ev.decode_threshold or 1})"
        else:
            action += "fix the server configuration or the expectation"
        out.append(Finding("EXPECTATION_UNMET", FAIL,
                           f"expectation {key}={want} was not met by any prompt", evid + hints, action))
    return out


def rule_tp_ranks(ev: LiveEvidence) -> list[Finding]:
    out = []
    for p in ev.prompts:
        ranks = sorted(p.per_rank)
        if len(ranks) <= 1 and ev.tensor_parallel_size <= 1:
            continue
        evid = []
        totals = {}
        for r in ranks:
            parts = [f"{k} {rc.calls} call(s)/{rc.tokens} token(s)" for k, rc in sorted(p.per_rank[r].items())]
            totals[r] = {k: (rc.calls, rc.tokens) for k, rc in p.per_rank[r].items()}
            evid.append(f"rank {r}: " + ", ".join(parts))
        missing = [str(i) for i in range(ev.tensor_parallel_size) if str(i) not in p.per_rank]
        uneven = len({tuple(sorted(t.items())) for t in totals.values()}) > 1
        sev = WARN if (missing and p.calls) or uneven else INFO
        summary = f"{_prompt_label(p)}: calls per tensor-parallel rank (TP={ev.tensor_parallel_size}); " + (
            "every rank runs every layer, counts are per rank, not summed" if sev == INFO else
            "ranks disagree" + (f", no record from rank(s) {', '.join(missing)}" if missing else ""))
        out.append(Finding("TP_RANKS", sev, summary, evid,
                           "" if sev == INFO else "check that the probe armed in every worker (Worker_TP<n>)"))
    return out


def rule_drafter_layers(ev: LiveEvidence) -> list[Finding]:
    out = []
    for p in ev.prompts:
        if not p.drafter_calls:
            continue
        evid = [_count_text(k, rc, len(rc.calls_per_layer) or 1) for k, rc in sorted(p.drafter_calls.items())]
        evid.append(f"main model layers: 0..{(ev.num_hidden_layers or 1) - 1}; layers at or beyond "
                    f"{ev.num_hidden_layers} are the MTP drafter (num_speculative_tokens={ev.num_speculative_tokens})")
        out.append(Finding("DRAFTER_LAYERS", INFO,
                           f"{_prompt_label(p)}: MTP drafter layer calls kept apart from the main model's counts",
                           evid))
    return out


def rule_prompt_problems(ev: LiveEvidence) -> list[Finding]:
    out = []
    for p in ev.prompts:
        if p.error:
            out.append(Finding("PROMPT_FAILED", WARN, f"{_prompt_label(p)} failed: {p.error}", [],
                               "read the server log at the time of the request"))
        if p.foreign_traffic:
            out.append(Finding("FOREIGN_TRAFFIC", WARN, f"{_prompt_label(p)}: other requests ran at the same time; "
                               "their calls are mixed into this prompt's counts, so no path is claimed for it",
                               [p.foreign_traffic], "re-run when the server is idle"))
    return out


def rule_chunked_prefill(ev: LiveEvidence) -> list[Finding]:
    """The `chunked` prompt (beyond max_num_batched_tokens): its prefill should take several steps, each
    through forward_mha; the later chunks carry the earlier ones as chunked context."""
    out = []
    for p in ev.prompts:
        if p.name != "chunked":
            continue
        obs = observed_path(p)
        evid = [p.purpose, f"observed: prefill={obs['prefill']} decode={obs['decode']} ({obs['why']})"]
        if obs["mha_steps"] >= 2:
            out.append(Finding("CHUNKED_PREFILL_OBSERVED", INFO,
                               f"{_prompt_label(p)}: the prefill was split into {obs['mha_steps']} chunks, each "
                               "through forward_mha (later chunks attend to the earlier ones as chunked context)",
                               evid))
        elif obs["mha_steps"] == 1:
            out.append(Finding("CHUNKED_PREFILL_NOT_SPLIT", INFO,
                               f"{_prompt_label(p)}: the prefill ran in one step, not split as "
                               "max_num_batched_tokens suggests", evid,
                               "check the scheduler settings the server really runs with (--max-num-batched-tokens)"))
    return out


RULES = (rule_not_restored, rule_server_failed, rule_probe_not_loaded, rule_probe_loaded_not_called,
         rule_files_modified_live, rule_expectations, rule_backends_selected, rule_mla_not_in_use,
         rule_config_log_disagree, rule_dsa_without_index_topk, rule_short_prompt_decode_only, rule_sparse_all_mqa,
         rule_decode_hidden, rule_path_unexpected, rule_route_resolved, rule_prefill_mha_observed,
         rule_decode_mqa_observed, rule_chunked_prefill, rule_tp_ranks, rule_drafter_layers, rule_prompt_problems)
_ORDER = {FAIL: 0, WARN: 1, INFO: 2}


def verdict(ev: LiveEvidence) -> list[Finding]:
    """All findings, NOT_RESTORED first, then by severity (fail, warn, info), rule order within."""
    found: list[Finding] = []
    for rule in RULES:
        found += rule(ev)
    return sorted(found, key=lambda f: (f.code != "NOT_RESTORED", _ORDER[f.severity]))
