"""``mla-doctor explain --log FILE``: the zero-patch reading of a pasted vLLM log, offline, no host."""
from __future__ import annotations

import json
import os
import stat
import sys

import click

from mla_doctor import terminal
from mla_doctor.cli.common import cli, handle_errors, terminal_width
from mla_doctor.diagnosis.explain import Explanation, explain
from mla_doctor.diagnosis.log_normalise import bounded_lines
from mla_doctor.diagnosis.log_tail import tail_lines
from mla_doctor.errors import UsageError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.redact import redact_text, redact_tree


def _read_config(path: str) -> dict:
    in_dir = os.path.isdir(path)
    p = os.path.join(path, "config.json") if in_dir else path
    try:
        # a model directory may be another user's: its config.json as a FIFO must not hang us, nor a device or
        # a huge file fill memory (a file named by hand may be a pipe: `--model <(...)`)
        fd = os.open(p, os.O_RDONLY | (os.O_NONBLOCK if in_dir else 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if in_dir and (not stat.S_ISREG(st.st_mode) or st.st_size > 16 << 20):
                raise UsageError(f"{p}: not a regular file of at most 16 MiB: not read")
            data = json.loads(f.read(16 << 20).decode("utf-8", "replace"))
    except OSError as e:
        raise UsageError(f"{p}: cannot read: {e.strerror or e}") from e
    except ValueError as e:
        raise UsageError(f"{p}: not JSON: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{p}: not a config.json object")
    return data


def answer_lines(ex: Explanation) -> list[str]:
    """What a 1-token and a long prompt do, as sentences (issue 32): the entry, the threshold as a number,
    expected or not; a full CUDA graph that hides the decode entry's Python said so."""
    from mla_doctor import words

    r = ex.reading
    full = r.cudagraph_mode if r.cudagraph_mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL") \
        and not r.eager else None
    backend = r.attention_backend.value if r.attention_backend is not None else None
    return [("answer: " if i == 0 else "        ") + words.prompt_answer(rt.to_dict(), ex.threshold, backend,
                                                                            r.engine, full)
            for i, rt in enumerate(ex.routes or [])]


def prompt_line(p: dict, rt) -> str:
    """`a 4096-token prompt -> forward_mha on NVIDIA SM100 with …, otherwise forward_mqa: [on SM90] why; …`: the
    route and each branch's conditions in words (issue 32), never the route's code wording (`when SM100 and
    unquantized KV`); a note added to the reason (chunked prefill) kept."""
    from mla_doctor import words

    d = rt.to_dict()
    why = p["why"]
    if len(d["branches"]) > 1:
        code_why = rt.why()
        extra = why[len(code_why):] if why.startswith(code_why) else ""
        why = "; ".join("[%s] %s" % (words.conditions(b["conditions"]) or "otherwise", b["why"])
                        for b in d["branches"]) + extra
    label = str(p["prompt"]).replace(" tokens", " token").replace(" ", "-")
    return f"a {label} prompt -> {words.route(d)}: {why}"


def life_lines(r) -> list[str]:
    """The process-life reading (issue 29): which process died, of what, the line that says why (the wrapper only
    as context), or a requested shutdown whose teardown errors are no death; lines no header placed."""
    life, out = r.life, []
    if life is not None and life.died:
        kind = f" ({life.death_kind})" if life.death_kind else ""
        who = "an unknown process" if life.died == "unknown" else "the " + life.died.replace("_", " ")
        out.append(f"died: {who}{kind}  [{life.died_rule}]")
        if r.fatal_cause is not None:
            out.append(f"why: {r.fatal_cause.text[:300]}  (line {r.fatal_cause.n})"
                       + (f", at {life.frame}" if life.frame else ""))
        else:
            out.append("why: not in the paste (its traceback is cut before the exception line)")
        if life.wrapper is not None:
            out.append(f"reported as: {life.wrapper.text[:200]}  (line {life.wrapper.n}; a wrapper, not the cause)")
    elif r.fatal_error is not None:
        out.append(f"ended by: {r.fatal_error.text[:300]}  (line {r.fatal_error.n})")
    if life is not None and life.shutdown:
        out.append(f"stopped on purpose: {life.shutdown_text[:200]}  (line {life.shutdown_line})"
                   + (f"; {len(life.teardown)} error(s) after it are teardown, not a crash" if life.teardown else ""))
    unplaced = (r.normalised or {}).get("unplaced")
    if unplaced:
        out.append(f"lines no vLLM header placed: {unplaced['count']} (read as plain text; first: line "
                   f"{unplaced['lines'][0]})")
    return out


def render_text(ex: Explanation, log: str) -> str:
    r = ex.reading
    out = [f"log: {log}"]
    out += answer_lines(ex)  # the answer in words first; the facts it rests on below
    ver = r.version or "not stated"
    if r.source_build:
        ver += " (a source build)"
    # the candidates once: the basis names them when nothing narrowed them (issue 28)
    out.append(f"vLLM: {ver}" + ("" if ex.release_ranges else f"; fits release(s): {', '.join(r.releases) or 'none'}"))
    out.append(f"knowledge applied: {ex.release or '-'} ({ex.release_basis})")
    if ex.facts_from:  # the model facts: the release's code (harvested) or the table (history)
        out.append(f"model facts from: {'the code' if ex.facts_from['source'] == 'code' else 'the table'} — "
                   f"{ex.facts_from['why']}")
    for rg in ex.release_ranges:
        e = rg["entries"]
        span = rg["from"] if rg["from"] == rg["to"] else f"{rg['from']}–{rg['to']}"
        out.append(f"  {span}: dispatch {e['dispatch'] or '-'}, prefill {e['prefill'] or '-'}, "
                   f"decode {e['decode'] or '-'}")

    def fact(label, f, value=None):
        if f is None:
            out.append(f"{label}: {value or 'not in the log'}")
        else:
            out.append(f"{label}: {value or f.value}  (line {f.n}, format {f.source})")

    def why(key):
        d = r.decided.get(key)
        return f"  [{d.rule}; line {', '.join(map(str, d.lines)) or '-'}]" if d is not None else ""

    inp = ex.input or {}
    if inp.get("dropped_lines") or inp.get("cut_lines"):
        out.append(f"read: lines {inp['kept_from_line']}-{inp['total_lines']} of {inp['total_lines']} "
                   f"(the newest {inp['cap_bytes'] >> 20} MiB); {inp['cut_lines']} line(s) cut at "
                   f"{inp['cap_line']} characters")
    if r.stopped:
        out.append(f"read stopped at line {r.stopped['at_line']}: {r.stopped['why']}")
    stripped = (r.normalised or {}).get("stripped") or {}
    if stripped:
        out.append("wrappers stripped: " + ", ".join(f"{k} x{v['count']} (from line {v['first_line']})"
                                                    for k, v in stripped.items()))
    fact("attention backend", r.attention_backend)
    out[-1] += why("attention_backend")
    fact("prefill backend", r.prefill_backend)
    out[-1] += why("prefill_backend")
    if r.crashed_backend is not None:
        out.append(f"backend that crashed (no selection line): {r.crashed_backend.value}  "
                   f"[{r.crashed_backend.rule}; line {r.crashed_backend.n}]")
    for f in r.other_backends:
        out.append(f"{f.role} backend (not the model's): {f.value or '?'}  (line {f.n})")
    out.append(f"engine: {r.engine or 'not in the log'}" + why("engine"))
    cg = f"CUDA graphs: {r.cudagraph_mode or 'not in the log'}" + (" (eager)" if r.eager else "")
    if r.cudagraph_mode_requested and r.cudagraph_mode_requested != r.cudagraph_mode:
        cg += f"; requested {r.cudagraph_mode_requested}"
    out.append(cg + why("cudagraph_mode"))
    if r.chunked_prefill is not None:
        out.append("chunked prefill: " + ("on" if r.chunked_prefill else "off")
                   + (f", max_num_batched_tokens={r.max_num_batched_tokens}" if r.max_num_batched_tokens else ""))
    out.append(f"sparse (DSA): {'yes' if r.sparse else 'no sign in the log' if r.sparse is None else 'no'}"
               + why("sparse"))
    if ex.model:
        out.append(f"model: {ex.model['model_type']} ({ex.model['architecture']}): {ex.model['reason']}")
    if ex.threshold is not None:
        out.append(f"decode threshold: {ex.threshold} ({ex.threshold_note})")
    for p, rt in zip(ex.prompts, ex.routes or []):
        out.append(prompt_line(p, rt))
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
    out += life_lines(r)
    for key, looked in r.unknown.items():
        out.append(f"could not tell the {key.replace('_', ' ')}: looked for {looked}")
    for u in ex.unresolved:
        out.append(f"not resolved: {u}")
    out.append(f"overall: {ex.status}")
    return "\n".join(out) + "\n"


def _read_log(log: str):
    """The paste, bounded: stdin for "-", else a regular file only. A FIFO, a device or a directory is refused
    at once (opened without blocking, checked before any read): one would hang, /dev/zero never end."""
    if log == "-":
        st = os.fstat(sys.stdin.fileno())
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode)
                or sys.stdin.isatty()):
            raise UsageError("-: stdin is not a file, a pipe or a terminal: not read")
        if stat.S_ISREG(st.st_mode):
            return tail_lines(sys.stdin.buffer)
        return bounded_lines(sys.stdin.buffer)
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UsageError(f"{log}: cannot read: {e.strerror or e}") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
        raise UsageError(f"{log}: not a regular file ({kind}): explain reads a file, or stdin as -")
    with os.fdopen(fd, "rb") as f:
        try:   # the newest MAX_LOG_BYTES, each line cut at MAX_LINE; what is dropped is never read as lines
            return tail_lines(f)
        except OSError as e:
            raise UsageError(f"{log}: cannot read: {e.strerror or e}") from e


@cli.command("explain")
@click.argument("log_arg", required=False, metavar="[LOG]")
@click.option("--log", "log", metavar="FILE", help="The vLLM server log (a paste is fine); - reads stdin.")
@click.option("--model", "model", metavar="DIR|config.json", help="The model's config, to classify it.")
@click.option("--version", "version", metavar="V", help="The vLLM version, when the log does not say it.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@handle_errors("explain")
def explain_cmd(log_arg, log, model, version, fmt):
    """Read a pasted vLLM log offline: release, backends, engine, CUDA graphs, sparse, fatal lines, and
    what a 1-token and a long prompt would do. Exit 1 when a fatal line is found."""
    if log_arg is not None and log is not None and log_arg != log:
        raise UsageError("give one log: LOG or --log, not both")
    log = log if log is not None else log_arg
    if log is None:
        raise UsageError("no log: give LOG, --log FILE, or - to read stdin")
    kept = _read_log(log)
    config = _read_config(model) if model else None
    ex = explain(kept.numbered(), config=config, version=version)
    ex.input = kept.to_dict()
    if fmt == "json":
        doc = redact_tree(dict(ex.to_dict(), command="explain", log=log))  # a paste goes on into tickets
        click.echo(json.dumps(doc, indent=2))
    else:
        # the paste is another machine's text: its escapes (OSC 52, ESC[2J) must not reach the terminal, nor
        # its secrets the ticket the answer is pasted into (every other output is redacted: this one was not)
        text = terminal.text("".join(redact_text(line) for line in render_text(ex, log).splitlines(keepends=True)))
        width = terminal_width(None)  # a terminal: each line wrapped to it, no word lost; piped: as is
        if width:
            from mla_doctor.reports.first_screen import fit

            text = "".join(ln + "\n" for line in text.splitlines() for ln in fit(line, width))
        click.echo(text, nl=False)
    raise SystemExit(int(ExitStatus.FAULT if ex.status == "fail" else ExitStatus.OK))
