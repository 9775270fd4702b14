"""``mla-doctor explain --log FILE``: the zero-patch reading of a pasted vLLM log, offline, no host."""
from __future__ import annotations

import json
import os

import click

from mla_doctor.cli.common import cli, handle_errors
from mla_doctor.diagnosis.explain import Explanation, explain
from mla_doctor.errors import UsageError
from mla_doctor.exit_codes import ExitStatus


def _read_config(path: str) -> dict:
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"{p}: cannot read: {e.strerror or e}") from e
    except ValueError as e:
        raise UsageError(f"{p}: not JSON: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{p}: not a config.json object")
    return data


def render_text(ex: Explanation, log: str) -> str:
    r = ex.reading
    out = [f"log: {log}"]
    ver = r.version or "not stated"
    if r.source_build:
        ver += " (a source build)"
    out.append(f"vLLM: {ver}; fits release(s): {', '.join(r.releases) or 'none'}")
    out.append(f"knowledge applied: {ex.release or '-'} ({ex.release_basis})")

    def fact(label, f, value=None):
        if f is None:
            out.append(f"{label}: {value or 'not in the log'}")
        else:
            out.append(f"{label}: {value or f.value}  (line {f.n}, format {f.source})")

    fact("attention backend", r.attention_backend)
    fact("prefill backend", r.prefill_backend)
    fact("engine", r.engine_line, r.engine)
    out.append(f"CUDA graphs: {r.cudagraph_mode or 'not in the log'}" + (" (eager)" if r.eager else ""))
    if r.chunked_prefill is not None:
        out.append("chunked prefill: " + ("on" if r.chunked_prefill else "off")
                   + (f", max_num_batched_tokens={r.max_num_batched_tokens}" if r.max_num_batched_tokens else ""))
    out.append(f"sparse (DSA): {'yes' if r.sparse else 'no sign in the log' if r.sparse is None else 'no'}")
    if ex.model:
        out.append(f"model: {ex.model['model_type']} ({ex.model['architecture']}): {ex.model['reason']}")
    if ex.threshold is not None:
        out.append(f"decode threshold: {ex.threshold} ({ex.threshold_note})")
    for p in ex.prompts:
        out.append(f"a {p['prompt']} prompt -> {p['path']}: {p['why']}")
    if r.fatal:
        out.append("fatal lines:")
        for f in r.fatal:
            src = f" (format {f.source})" if f.source else ""
            out.append(f"  {f.n}: {f.text}{src}")
    if len(r.runs) > 1:
        cur = r.runs[-1]
        out.append(f"server processes in the log: {len(r.runs)}; read: the newest, lines "
                   f"{cur.first_line}-{cur.last_line}")
    if r.earlier_fatal:
        out.append("fatal lines of earlier server processes (not the newest's):")
        out += [f"  {f.n}: {f.text}" for f in r.earlier_fatal[:10]]
    for u in ex.unresolved:
        out.append(f"not resolved: {u}")
    out.append(f"overall: {ex.status}")
    return "\n".join(out) + "\n"


@cli.command("explain")
@click.option("--log", "log", required=True, metavar="FILE", help="The vLLM server log (a paste is fine).")
@click.option("--model", "model", metavar="DIR|config.json", help="The model's config, to classify it.")
@click.option("--version", "version", metavar="V", help="The vLLM version, when the log does not say it.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@handle_errors("explain")
def explain_cmd(log, model, version, fmt):
    """Read a pasted vLLM log offline: release, backends, engine, CUDA graphs, sparse, fatal lines, and
    what a 1-token and a long prompt would do. Exit 1 when a fatal line is found."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"{log}: cannot read: {e.strerror or e}") from e
    config = _read_config(model) if model else None
    ex = explain(lines, config=config, version=version)
    if fmt == "json":
        doc = dict(ex.to_dict(), command="explain", log=log)
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render_text(ex, log), nl=False)
    raise SystemExit(int(ExitStatus.FAULT if ex.reading.fatal else ExitStatus.OK))
