"""Record what the REAL host agent answers, for the unit tests' fake agent (tests/support/fake_agent.py).

Starts the real vLLM CPU server on a free loopback port (tests/support/vllm_cpu.py), then runs, in this
process, the CLI exactly as a user would:

* ``mla-doctor static --local --python <vllm venv python>`` -> ``tests/fixtures/agent/static_local.json``
* ``mla-doctor run --local --yes --python <vllm venv python> --format json`` -> ``run_local.json``

Every agent execution is recorded by wrapping ``mla_doctor.remote.runner.run_agent`` (and every module's
own reference to it): the plan sent and the answer received, in order. The HTTP exchanges with the server
(``HostHTTP.request``: /health, /v1/models, /tokenize, /v1/completions, /metrics) are recorded in the same
sequence, since the live run talks to the server directly with ``--local``. Nothing is redacted (the agent
redacts what it must); /metrics bodies are cut to the samples the controller reads (``trim_metrics``),
and a big plan field sent again unchanged is stored once (``compact``, expanded by ``fake_agent.load``).
The file is laid out for review (``tests/support/fixture_json.py``: indented, long texts line by line).

Regenerate (about 3 minutes: one server start, two restarts and a restore)::

    .venv/bin/python tests/support/record_agent.py            # both recordings
    .venv/bin/python tests/support/record_agent.py static     # only the static one

then review ``git diff tests/fixtures/agent`` and run ``pytest tests/unit/test_live_steps.py
tests/unit/test_static_report.py``: the tests assert what the recorded run found, so a new vLLM pin or a
changed agent shows up there.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "tests" / "fixtures" / "agent"
RUN_ROOT = "/var/tmp/mla-doctor-record"  # fixed, so the recorded plans do not change with a temp dir name


# the /metrics samples kept: the two the controller reads (idle check, foreign traffic) and their neighbours
METRICS_KEPT = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total")


def trim_metrics(text: str) -> str:
    """/metrics cut to METRICS_KEPT: the rest (histogram buckets, process metrics) is ~35 kB per call."""
    keep = [ln for ln in text.splitlines() if ln.split("{", 1)[0].split(" ", 1)[0] in METRICS_KEPT]
    return "\n".join(keep) + "\n"


def compact(exchanges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Lossless: a big plan field sent again unchanged (every tick's log patterns) is stored once;
    the repeat says {"$same_as": index of the exchange that has it}. fake_agent.load() expands it."""
    out: list[dict[str, Any]] = []
    last: dict[tuple[str, str], tuple[int, str]] = {}
    for i, ex in enumerate(exchanges):
        ex = dict(ex)
        if ex.get("kind") == "agent":
            plan = dict(ex["plan"])
            for k, v in plan.items():
                text = json.dumps(v, sort_keys=True)
                if len(text) < 1000 or isinstance(v, dict) and "$same_as" in v:
                    continue
                seen = last.get((ex["op"], k))
                if seen and seen[1] == text:
                    plan[k] = {"$same_as": seen[0]}
                else:
                    last[(ex["op"], k)] = (i, text)
            ex["plan"] = plan
        elif ex.get("path") == "/metrics" and "text" in ex:
            ex["text"] = trim_metrics(ex["text"])
        out.append(ex)
    return out


class Recorder:
    """Wraps run_agent and HostHTTP.request for the duration of a `with` block; `exchanges` is the log."""

    def __init__(self) -> None:
        self.exchanges: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def recording(self):
        import mla_doctor.remote.http as http_mod
        from mla_doctor.remote import runner

        real_run_agent = runner.run_agent
        real_request = http_mod.HostHTTP.request
        exchanges = self.exchanges

        def run_agent(transport, plan, **kw):
            try:
                answer = real_run_agent(transport, plan, **kw)
            except Exception as e:
                exchanges.append({"kind": "agent", "op": plan.get("op"), "plan": plan,
                                  "raises": {"type": type(e).__name__, "message": str(e)}})
                raise
            exchanges.append({"kind": "agent", "op": plan.get("op"), "plan": plan, "answer": answer})
            return answer

        def request(self_http, method, path, body=None, timeout=None, auth=False):
            try:
                status, data = real_request(self_http, method, path, body, timeout, auth)
            except Exception as e:
                exchanges.append({"kind": "http", "method": method, "path": path, "body": body,
                                  "raises": {"type": type(e).__name__, "message": str(e)}})
                raise
            text = data.decode("utf-8", "replace")
            exchanges.append({"kind": "http", "method": method, "path": path, "body": body, "status": status,
                              "text": text})
            return status, data

        patched = []
        for name, mod in list(sys.modules.items()):
            if name.startswith("mla_doctor") and getattr(mod, "run_agent", None) is real_run_agent:
                patched.append(mod)
                mod.run_agent = run_agent
        http_mod.HostHTTP.request = request
        try:
            yield self
        finally:
            for mod in patched:
                mod.run_agent = real_run_agent
            http_mod.HostHTTP.request = real_request


def run_cli(args: list[str]) -> tuple[int, str]:
    """`mla-doctor ARGS --output FILE` in this process; (exit status, the report's text)."""
    from mla_doctor.cli import main

    with tempfile.TemporaryDirectory(prefix="mla-doctor-record-") as tmp:
        out = Path(tmp) / "report.json"
        try:
            main([*args, "--output", str(out)])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        return code, out.read_text() if out.exists() else ""


def record(kind: str, args: list[str]) -> dict[str, Any]:
    import mla_doctor.cli  # noqa: F401  (imports every module that holds a run_agent reference)
    import mla_doctor.host.live  # noqa: F401

    rec = Recorder()
    t0 = time.time()
    with rec.recording():
        code, out = run_cli(args)
    try:
        report = json.loads(out)
    except ValueError:
        report = {"unparsed_stdout": out[-4000:]}
    return {"recorded": time.strftime("%Y-%m-%d", time.gmtime(t0)), "command": ["mla-doctor", *args],
            "exit_code": code, "exchanges": compact(rec.exchanges), "report": report}


def save(name: str, doc: dict[str, Any]) -> Path:
    """Write the recording in the fixtures' layout (tests/support/fixture_json.py): indented, small values on
    one line, long texts line by line, so that a re-recording reads as a diff."""
    from tests.support.fixture_json import dumps, join_text, split_text

    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"{name}.json"
    text = dumps(split_text(doc))
    assert join_text(json.loads(text)) == json.loads(json.dumps(doc))  # lossless
    path.write_text(text)
    return path


def main(which: list[str]) -> int:
    from tests.support import vllm_cpu

    which = which or ["static", "run"]
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    py = str(vllm_cpu.venv_python())
    shutil.rmtree(RUN_ROOT, ignore_errors=True)
    with vllm_cpu.local_server() as server:
        print(f"server ready at {server.url}", file=sys.stderr)
        if "static" in which:
            doc = record("static", ["static", "--local", "--python", py, "--format", "json"])
            print("static:", save("static_local", doc), f"exit {doc['exit_code']}", file=sys.stderr)
        if "run" in which:
            doc = record("run", ["run", "--local", "--yes", "--method", "patch", "--python", py, "--format", "json",
                                 "--run-root", RUN_ROOT, "--ready-timeout", "300"])
            print("run:", save("run_local", doc), f"exit {doc['exit_code']}", file=sys.stderr)
    shutil.rmtree(RUN_ROOT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
