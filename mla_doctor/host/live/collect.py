"""After the run: each pass's evidence (settings, log slice, probe records, prompts) and the verdict."""
from __future__ import annotations

from mla_doctor.diagnosis.evidence_build import build_live_evidence
from mla_doctor.diagnosis.live_verdict import expected_path, observed_path, routing_of, verdict
from mla_doctor.host.live.records import malformed_findings
from mla_doctor.host.live.session import LiveRun
from mla_doctor.host.live.steps import Pass
from mla_doctor.report_sections import EvidenceSection, ModelSection
from mla_doctor.results import Finding, HostReport, Severity, plain

# the static audit's integrity/model findings that the live rules do not restate
KEEP_STATIC = {"VLLM_FILES_MISSING", "VLLM_FILES_UNRECORDED", "VLLM_INTEGRITY_UNKNOWN", "VLLM_PLUGINS_INSTALLED",
               "PTH_IMPORTS", "MODEL_STARTUP_FAILURE", "MLA_DISABLED_BY_ENV", "BACKEND_ENV_IGNORED",
               "VLLM_VERSION_UNKNOWN", "FACT_UNCONFIRMED", "VLLM_FILES_MODIFIED"}


def evidence(run: LiveRun, p: Pass):
    """The evidence of one pass, for the live rules."""
    report, server, ropts, live = run.report, run.server, run.ropts, run.live
    env = live.get("settings") or {}
    settings = {"env": env, "restarted": run.restarted, "enforce_eager": server.get("enforce_eager"),
                "server_python": (report.vllm or {}).get("python"), "python": (report.vllm or {}).get("python"),
                "container": (server.get("supervisor") or {}).get("kind") in ("docker", "kubernetes"),
                "vllm_plugins": (server.get("env") or {}).get("VLLM_PLUGINS")}
    if p.configuration != "production":
        settings["added_args"] = list(ropts.second_pass)
        if "--enforce-eager" in ropts.second_pass:
            settings["enforce_eager"] = True
    return build_live_evidence(
        facts=run.facts, version=(report.vllm or {}).get("version"),
        model_config=ModelSection.of(report.model).config, static=report.static, server=server,
        gpu=report.gpu, log_lines=[ln["text"] for ln in run.log_lines[p.log_from:p.log_to]],
        records_armed=run.armed + [r for r in run.startup if r.get("event") != "armed"],
        prompts=p.prompts, configuration=p.configuration, settings=settings,
        method=ropts.method, expectations=ropts.expect, server_started=p.start_error is None,
        start_error=p.start_error, restored=report.restored,
        restore_detail="; ".join(live.get("restore_problems") or []) or None)


def conclude(run: LiveRun, passes: list[Pass]) -> HostReport:
    """Every pass's verdict and prompts into the report, with the static findings the live rules keep."""
    report = run.report
    findings: list[Finding] = []
    report.prompts = []
    results = [(p, evidence(run, p)) for p in passes]
    for p, ev in results:
        found = verdict(ev)
        if p.configuration != "production":
            for f in found:
                f.summary = f"[{p.configuration}: {' '.join(ev.settings.get('added_args') or [])}] {f.summary}"
        findings += found
        for obs, _recs in p.prompts:
            report.prompts.append({
                "name": obs.name, "prompt_tokens": obs.prompt_tokens, "max_tokens": obs.max_tokens,
                "purpose": obs.purpose, "configuration": obs.configuration,
                "calls": {k: {"calls": c.calls, "tokens": c.tokens, "unknown_tokens": c.unknown_tokens,
                              "tokens_per_layer": c.tokens_per_layer} for k, c in obs.calls.items()},
                "per_rank": {r: {k: {"calls": c.calls, "tokens": c.tokens} for k, c in d.items()}
                             for r, d in obs.per_rank.items()},
                "drafter_calls": {k: {"calls": c.calls, "tokens": c.tokens} for k, c in obs.drafter_calls.items()},
                "dispatch": obs.dispatch[:8], "builder": obs.builder[:8],
                "expected": expected_path(ev, obs), "observed": observed_path(obs),
                "routing": routing_of(ev, obs).to_dict(),  # the route's conditions and what the probe resolved
                "foreign_traffic": obs.foreign_traffic, "completion": obs.completion, "error": obs.error})
        if p.start_error and not any(f.code == "SERVER_FAILED_TO_START" for f in found):
            findings.append(Finding("SERVER_FAILED_TO_START", Severity.FAIL,
                                    f"the server did not start under the run's settings ({p.configuration}): "
                                    f"{p.start_error}"))
    findings += malformed_findings(run.live)  # forged or broken probe records: left out, and said
    for text in (run.live.get("attach") or {}).get("warnings") or []:  # attach's own blind spot, said
        findings.append(Finding("ATTACH_COMPILED_FRAMES", Severity.WARN, text))
    codes = {f.code for f in findings}
    report.findings = findings + [f for f in report.findings if f.code in KEEP_STATIC and f.code not in codes]
    report.evidence = EvidenceSection.from_dict(
        {k: v for k, v in plain(results[0][1]).items() if k != "prompts"})  # the prompts: rendered per prompt above
    return report
