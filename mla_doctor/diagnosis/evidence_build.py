"""Build the live verdict's input (`LiveEvidence`) from what a run collected. Pure: no I/O.

The server log decides what the server really did (engine, backends, CUDA-graph mode, sparse):
`static_facts.parse_log` reads it with the one log reader (`log_reading`). `config.json` says what the model
*should* be (`verify.classify_model`); when the two disagree the verdict says so and believes the log.
Probe records are folded per prompt with `evidence.observe`.
"""
from __future__ import annotations

from typing import Any

from mla_doctor.diagnosis.evidence import ROLE_KEYS, LiveEvidence, PromptObservation, RoleCount, observe
from mla_doctor.diagnosis.knowledge import ReleaseFacts
from mla_doctor.diagnosis.log_reading import installed_records
from mla_doctor.diagnosis.routing import family_of, kv_dtype_from_argv, model_dims
from mla_doctor.diagnosis.static_facts import LogEvidence, classify_model, parse_log
from mla_doctor.report_sections import StaticSection

__all__ = ["build_live_evidence", "resolve_threshold", "text_config"]

FULL_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "V0_FULL_DECODE")

def text_config(config: dict | None) -> dict:
    """The language model's config (``text_config`` of a multimodal wrapper, else the config)."""
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) and text.get("model_type") else config


def _parse(facts: ReleaseFacts, lines: list[Any], harvested: list[dict] | None = None,
           version: str | None = None) -> LogEvidence:
    # the one log reader (log_reading via parse_log): its normaliser keeps each line's number, so the
    # evidence quotes the record at the line the log has it
    return parse_log(facts, lines, harvested=harvested, version=version)


def _major(cc: Any) -> int | None:
    try:
        return int(str(cc).split(".")[0])
    except (TypeError, ValueError):
        return None


def resolve_threshold(value: Any, *, local_heads: int | None, compute_cap: Any) -> tuple[int | None, str]:
    """An int threshold as is; a head-dependent table ({platform: {heads: n, "default": n}}) resolved."""
    if isinstance(value, int) or value is None:
        return value, ""
    if not isinstance(value, dict) or not value:
        return None, "threshold table unreadable"
    major = _major(compute_cap)
    if "any" in value:
        plat = "any"
    elif major == 10 and "sm100" in value:
        plat = "sm100"
    else:
        plat = "other" if "other" in value else next(iter(value))
    table = value.get(plat) or {}
    if local_heads is not None and local_heads in table:
        return int(table[local_heads]), f"{plat} table, {local_heads} local query heads"
    if local_heads is not None:
        bigger = sorted(k for k in table if isinstance(k, int) and k >= local_heads)
        if bigger:
            return int(table[bigger[0]]), f"{plat} table, {local_heads} local query heads (row {bigger[0]})"
    dflt = table.get("default")
    return (int(dflt) if dflt is not None else None), f"{plat} table, local query heads unknown: default"


def _ref(file: str | None, line: Any, symbol: str | None) -> str:
    if not file:
        return symbol or "?"
    f = file if file.startswith("vllm/") else "vllm/" + file
    return f"{f}{':' + str(line) if line else ''} {symbol or ''}".strip()


def _static_ref(static: StaticSection, key: str) -> dict | None:
    r = getattr(static, key)
    return r if isinstance(r, dict) and r.get("file") else None


def _entry_refs(facts: ReleaseFacts, static: StaticSection, backend: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for role, key, entry in (("dispatch", "dispatch", facts.dispatch), ("prefill", "prefill_entry", facts.prefill),
                             ("decode", "decode_entry", facts.decode_common)):
        r = _static_ref(static, key)
        if r:
            out[role] = _ref(r["file"], r.get("line"), r.get("symbol"))
        elif (static.extra_ or {}).get("entries_from"):
            continue  # the served family's layer has no such entry (code_paths.served_entries): never the table's
        elif entry is not None:
            out[role] = _ref(entry.def_path, None, entry.symbol)
    b = facts.backend(backend) if backend else None
    if b is not None:
        found = [r for r in static.decode_entries
                 if isinstance(r, dict) and r.get("backend") == backend and r.get("file")]
        if found:
            out["backend_decode"] = _ref(found[0]["file"], found[0].get("line"), found[0].get("symbol"))
        else:
            out["backend_decode"] = _ref(b.decode[0].def_path, None, b.decode[0].symbol)
    if facts.metadata_split is not None:
        out["split"] = _ref(facts.metadata_split.file, None, facts.metadata_split.symbol)
    return out


def _records_with_calls(records: list[dict]) -> list[dict]:
    return [r for r in records or [] if isinstance(r, dict) and r.get("event") == "call"]


def build_live_evidence(*, facts: ReleaseFacts, version: str | None, model_config: dict | None,
                        static: StaticSection | dict | None, server: dict | None, gpu: dict | None,
                        log_lines: list[Any],
                        records_armed: list[dict], prompts: list[tuple[PromptObservation, list[dict]]],
                        configuration: str = "production", settings: dict | None = None, method: str = "patch",
                        expectations: dict | None = None, server_started: bool = True,
                        start_error: str | None = None, restored: bool | None = None,
                        restore_detail: str | None = None) -> LiveEvidence:
    """Everything the live verdict reads, from one run.

    ``records_armed`` are the records seen outside any prompt: the probe's ``armed`` events (one per
    process that loaded it) and any ``call`` made at startup (CUDA-graph capture / warm-up), which are
    kept apart in ``startup_calls``. ``prompts`` pairs each prompt with the records of its window.
    """
    settings = dict(settings or {})
    server = server or {}
    # the formats the static audit harvested from the installed vllm/ (this process), else the shipped ones
    harvested = installed_records(static)
    st = StaticSection.of(static)
    log = _parse(facts, log_lines or [], harvested, version)
    cfg = text_config(model_config)
    mc = classify_model(facts, model_config) if model_config else None
    n_layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else None
    tp = server.get("tensor_parallel_size") or settings.get("tensor_parallel_size") or 1
    nspec = server.get("num_speculative_tokens")
    if nspec is None:
        nspec = settings.get("num_speculative_tokens")
    gpus = (gpu or {}).get("gpus") or []
    g0 = gpus[0] if gpus and isinstance(gpus[0], dict) else {}

    ev = LiveEvidence(version=version, configuration=configuration, settings=settings, method=method)
    ev.log_found = bool(log_lines)
    ev.possible_engines = list(facts.engines)
    ev.engine = log.engine  # from the log only: never guessed from the version
    ev.engine_line = log.engine_line.text if log.engine_line else None
    ev.decode_backend = log.decode_backend
    ev.decode_backend_is_mla = log.decode_backend_is_mla
    ev.prefill_backend = log.prefill_backend
    ev.prefill_backend_line = log.prefill_backend_line.text if log.prefill_backend_line else None
    ev.backend_lines = [ll.text for ll in log.backend_lines]
    if log.prefill_backend_line is not None:
        ev.backend_lines.append(log.prefill_backend_line.text)
    ev.sparse_lines = [ll.text for ll in log.sparse_lines]
    ev.cudagraph_lines = [ll.text for ll in log.cudagraph_lines]
    ev.mla_lines = [ll.text for ll in log.mla_lines]
    ev.fatal_lines = [ll.text for ll in log.fatal_lines]
    ev.breakable_cudagraph = True if any(ll.id == "breakable_cg" for ll in log.cudagraph_lines) else None

    # eager / CUDA-graph mode: the log first, then the debug settings of the run, then the server's argv
    eager = log.eager
    if eager is None and settings.get("enforce_eager") is not None:
        eager = bool(settings["enforce_eager"])
    if eager is None and server.get("enforce_eager") is not None and server:
        eager = bool(server["enforce_eager"])
    if eager is None and configuration == "eager":
        eager = True
    ev.eager = eager
    ev.cudagraph_mode = log.cudagraph_mode or settings.get("cudagraph_mode") or ("NONE" if eager else None)

    # the model, from config.json
    if mc is not None:
        ev.model_type, ev.architecture = mc.model_type, mc.architecture
        ev.config_is_mla, ev.config_is_sparse = mc.is_mla, mc.is_sparse
        ev.model_reason, ev.model_routing, ev.model_startup_failure = mc.reason, mc.routing, mc.startup_failure
    topk = cfg.get("index_topk", (model_config or {}).get("index_topk"))
    ev.index_topk = topk if isinstance(topk, int) else None
    ev.num_hidden_layers = n_layers
    heads = cfg.get("num_attention_heads")
    ev.num_attention_heads = heads if isinstance(heads, int) else None
    dims = model_dims(model_config)
    ev.model_dims = list(dims) if dims else None
    ev.kv_cache_dtype = kv_dtype_from_argv(server.get("argv"))
    ev.tensor_parallel_size = int(tp)
    ev.num_speculative_tokens = nspec
    ev.gpu = g0.get("name")
    ev.compute_capability = str(g0["compute_cap"]) if g0.get("compute_cap") is not None else None

    # the selected backend's facts in this release
    b = facts.backend(ev.decode_backend) if ev.decode_backend else None
    ev.decode_backend_sparse = b.sparse if b is not None else None
    sparse_seen = bool(b is not None and b.sparse) or bool(log.sparse_lines)
    if sparse_seen:
        ev.log_is_sparse = True
    elif ev.decode_backend is not None:
        ev.log_is_sparse = False  # a dense backend was selected and nothing sparse was logged
    ev.sparse_mode, ev.sparse_routing = facts.sparse_mode, facts.sparse_routing
    if b is not None and b.threshold is not None:
        local = (ev.num_attention_heads // max(1, ev.tensor_parallel_size)) if ev.num_attention_heads else None
        value, how = resolve_threshold(b.threshold.value, local_heads=local, compute_cap=ev.compute_capability)
        ev.decode_threshold = value
        tref = st.threshold_refs.get(b.name)
        if isinstance(tref, dict) and tref.get("file"):
            ev.decode_threshold_ref = _ref(tref["file"], tref.get("line"), tref.get("symbol"))
        else:
            ev.decode_threshold_ref = _ref(b.threshold.file, None, b.threshold.symbol)
        notes = [n for n in (how, b.threshold.note) if n]
        if nspec and value is not None and value < 1 + int(nspec):
            notes.append(f"speculative decoding ({nspec} tokens) raises it to {1 + int(nspec)} where the backend "
                         "supports it")
        ev.decode_threshold_note = "; ".join(notes) or None
    ev.backend_cudagraph_support = b.cudagraph if b is not None else None
    ev.full_cudagraph_decode = _full_decode(facts, ev)
    ev.entry_refs = _entry_refs(facts, st, ev.decode_backend)
    ev.family = family_of(st.code_paths, facts, model_config)
    ev.modified_files = list(st.modified_files)

    # the run
    ev.server_started, ev.start_error = server_started, start_error
    ev.restored, ev.restore_detail = restored, restore_detail
    ev.expectations = dict(expectations or {})
    ev.armed = [r for r in records_armed or [] if isinstance(r, dict) and r.get("event") == "armed"]
    for r in _records_with_calls(records_armed):
        key = ROLE_KEYS.get(r.get("role"))
        if key:
            where = ".".join(x for x in (r.get("class"), (r.get("function") or "").rsplit(".", 1)[-1]) if x)
            ev.startup_calls.setdefault(key, RoleCount()).add((r.get("tokens") or {}).get("q_rows"), r.get("layer"),
                                                              r.get("capturing"), where or None)
    for prompt, records in prompts or []:
        for r in records or []:  # armed events inside a prompt window (a lazily started process)
            if isinstance(r, dict) and r.get("event") == "armed" and r not in ev.armed:
                ev.armed.append(r)
        observe(prompt, list(records or []), n_layers)
        ev.prompts.append(prompt)
    return ev


def _full_decode(facts: ReleaseFacts, ev: LiveEvidence) -> bool | None:
    """Do pure-decode steps replay a full CUDA graph (decode entry silent) with this backend and mode?"""
    if ev.eager:
        return False
    if ev.breakable_cudagraph:
        return False  # DSA: the sparse attention call breaks out of the graph and runs eagerly
    engine = ev.engine or (facts.engines[0] if len(facts.engines) == 1 else None)
    if engine == "V0":
        return True  # V0 captures the whole model for decode-only batches
    mode = ev.cudagraph_mode
    if mode is None and engine == "V1" and facts.cudagraph is not None:
        mode = facts.cudagraph.mode  # the release's default: the log did not print the mode
    if mode is None:
        return None
    if mode not in FULL_MODES:
        return False
    support = ev.backend_cudagraph_support
    if support is None:
        return None
    return support in facts.full_decode_support
