"""The attach probe and its injection (issue 22), against real processes and the real gdb, no vLLM:
a plain CPython whose classes stand in for vLLM's MLA impls (same method names and arguments).

The probe is rendered by the controller's code (host/live/attach.py's template, the file probe inside),
injected by the agent's code (agent/attach/inject.py), and must: record the calls, return what the
original returns and let through what it raises, restore every wrapped attribute when the lease ends,
and never run a probe file that is not exactly the one the agent wrote.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mla_doctor.agent.attach import checks, elf, inject
from mla_doctor.host.instrument import Templates

PY = "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else "/usr/bin/python3"
GDB = inject.find_gdb()

IMPL = textwrap.dedent('''
    class MLACommonImpl:
        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            return ("mqa", len(q))

        def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output):
            raise ValueError("prefill failed: %d" % len(q))

    class CPUMLAImpl(MLACommonImpl):
        pass
''')

# the target: calls both entries in a loop and checks every result, as vLLM would see them
TARGET = textwrap.dedent('''
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    import fakemla
    impl, out, bad = fakemla.CPUMLAImpl(), open(sys.argv[2], "a"), 0
    orig = fakemla.MLACommonImpl.__dict__["forward_mqa"]
    out.write("ready\\n"); out.flush()
    deadline = time.time() + float(sys.argv[3])
    while time.time() < deadline and not os.path.exists(sys.argv[4]):
        if impl.forward_mqa([1, 2, 3], None, None, None) != ("mqa", 3):
            bad += 1
        try:
            impl.forward_mha([1] * 7, None, None, None, None, None, None)
            bad += 1
        except ValueError as e:
            bad += str(e) != "prefill failed: 7"
        time.sleep(0.01)
    same = fakemla.MLACommonImpl.__dict__["forward_mqa"] is orig
    out.write(json.dumps({"bad": bad, "restored": same, "attached": getattr(sys, "_mla_doctor_attached", None)})
              + "\\n")
''')



def gdb_or_fail():
    if GDB is None:
        pytest.fail("no root-owned gdb on this machine: the attach tests need it (apt-get install gdb); "
                    "`make setup` installs it as root")
    return GDB


def render(run_dir: Path, ttl: float, targets=None, plant=None) -> bytes:
    t = Templates()
    probe = t.render("probe_module.py.j2", run_id="t1", records_dir=str(run_dir / "records"),
                     lease_path=str(run_dir / "lease.json"), max_detail=4, flush_s=0.1)
    if plant is not None:
        assert plant[0] in probe
        probe = probe.replace(*plant)
    targets = targets or {"fakemla": [["*.forward_mqa", "decode-1", "decode"],
                                      ["MLACommonImpl.forward_mha", "prefill-1", "prefill"]]}
    src = t.render("attach_probe.py.j2", run_id="t1", module="mla_doctor_probe_t1", targets=targets,
                   probe_source=probe, debug_logs=True)
    (run_dir / "records").mkdir(parents=True, exist_ok=True)
    (run_dir / "lease.json").write_text(json.dumps({"expires": time.time() + ttl, "ttl": ttl, "epoch": 0}))
    return src.encode()


def start_target(tmp: Path, seconds: float = 300.0):
    """The target, calling both entries until `stop(tmp)` (an event: the test has seen what it waits for, however
    slow a loaded machine made gdb's attach) or, as a cap, `seconds`."""
    (tmp / "fakemla.py").write_text(IMPL)
    (tmp / "target.py").write_text(TARGET)
    log = tmp / "target.out"
    p = subprocess.Popen([PY, str(tmp / "target.py"), str(tmp), str(log), str(seconds), str(tmp / "stop")], cwd=tmp,
                         stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60  # generous: a loaded machine
    while not (log.exists() and "ready" in log.read_text()):
        assert time.monotonic() < deadline and p.poll() is None, "target did not start"
        time.sleep(0.05)
    return p, log


def stop(tmp: Path) -> None:
    (tmp / "stop").touch()


def records(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted((run_dir / "records").glob("probe-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def wait_for(pred, timeout=60.0, what="condition"):  # generous: only a hang fails it
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def write_probe(run_dir: Path, data: bytes) -> Path:
    path = run_dir / "attach-probe.py"
    path.write_bytes(data)
    os.chmod(path, 0o644)
    return path


def test_injected_probe_records_returns_raises_unchanged_and_restores_when_the_lease_ends(tmp_path):
    gdb = gdb_or_fail()
    p, log = start_target(tmp_path)
    try:
        data = render(tmp_path / "run", ttl=3.0)
        path = write_probe(tmp_path / "run", data)
        code = inject.bootstrap(str(path), hashlib.sha256(data).hexdigest(), len(data), os.geteuid())
        ok, detail = inject.inject(gdb, p.pid, code)
        assert ok, detail
        recs = wait_for(lambda: [r for r in records(tmp_path / "run") if r["event"] == "detached"] and
                        records(tmp_path / "run"), what="the probe's detached record")
    finally:
        stop(tmp_path)
        p.wait(30)
    by = {}
    for r in recs:
        by.setdefault(r["event"], []).append(r)
    assert len(by["armed"]) == 1 and by["armed"][0]["pid"] == p.pid
    assert by["attached"][0]["wrapped"] == ["MLACommonImpl.forward_mha", "MLACommonImpl.forward_mqa"]
    calls = {r["function"] for r in by["call"]}
    assert calls == {"MLACommonImpl.forward_mha", "MLACommonImpl.forward_mqa"}
    assert all(r["class"] == "CPUMLAImpl" for r in by["call"])
    assert by["call"][0]["tokens"]["q_rows"] is None  # a list has no .shape: unknown, never 0
    det = by["detached"][0]
    assert det["reason"] == "lease ended" and det["still_wrapped"] == [] and det["restored"] == 2
    expires = json.loads((tmp_path / "run" / "lease.json").read_text())["expires"]
    assert expires <= det["ts"] < expires + 10  # not before the lease ends; soon after (a poll, a loaded machine)
    # nothing after the detach; the target saw every result unchanged and got its class back
    assert recs[-1]["event"] == "detached"
    final = json.loads(log.read_text().splitlines()[-1])
    assert final == {"bad": 0, "restored": True, "attached": None}


def test_a_second_injection_of_the_same_run_does_not_wrap_twice(tmp_path):
    gdb = gdb_or_fail()
    p, log = start_target(tmp_path)
    run = tmp_path / "run"
    try:
        data = render(run, ttl=60.0)
        path = write_probe(run, data)
        code = inject.bootstrap(str(path), hashlib.sha256(data).hexdigest(), len(data), os.geteuid())
        assert inject.inject(gdb, p.pid, code)[0]
        wait_for(lambda: any(r["event"] == "attached" for r in records(run)), what="attached")
        assert inject.inject(gdb, p.pid, code)[0]
        # pending calls run in order: once this one has run, so has the second injection
        marker = tmp_path / "after-second"
        assert inject.inject(gdb, p.pid, "open(%r, 'w').close()" % str(marker))[0]
        wait_for(marker.exists, what="the pending calls to run")
        (run / "lease.json").write_text(json.dumps({"expires": 1, "ttl": 0, "epoch": 0, "detach": True}))
        wait_for(lambda: any(r["event"] == "detached" for r in records(run)), what="detached")
    finally:
        p.kill()
        p.wait(30)
    events = [r["event"] for r in records(run) if r["event"] in ("attached", "detached")]
    assert events == ["attached", "detached"]


@pytest.mark.parametrize("tamper", ["content", "symlink", "group-writable", "other-owner"])
def test_the_bootstrap_runs_only_the_exact_probe_file_the_agent_wrote(tmp_path, tamper):
    """A local user racing the probe file: changed bytes, a symlink swapped in, a loosened mode, another
    owner — the interpreter runs none of them."""
    gdb = gdb_or_fail()
    p, _log = start_target(tmp_path)
    marker = tmp_path / "ran"
    good = ("open(%r, 'w').write('good')\n" % str(marker)).encode()
    evil = ("open(%r, 'w').write('evil')\n" % str(marker)).encode()
    run = tmp_path / "run"
    run.mkdir()
    path = write_probe(run, good)
    code = inject.bootstrap(str(path), hashlib.sha256(good).hexdigest(), len(good), os.geteuid())
    if tamper == "content":
        path.write_bytes(evil[:len(good)])
    elif tamper == "symlink":
        (tmp_path / "elsewhere.py").write_bytes(good)
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere.py")
    elif tamper == "group-writable":
        os.chmod(path, 0o664)
    else:
        os.chown(path, 65534, 65534)
    after = tmp_path / "after"
    try:
        assert inject.inject(gdb, p.pid, code)[0]
        # pending calls run in order: once this one has run, the tampered bootstrap has had its chance
        assert inject.inject(gdb, p.pid, "open(%r, 'w').close()" % str(after))[0]
        wait_for(after.exists, what="the pending calls to run")
    finally:
        stop(tmp_path)
        p.wait(30)
    assert not marker.exists()
    assert p.returncode == 0


def test_the_untampered_bootstrap_does_run(tmp_path):
    """The control for the test above: the same file, untouched, runs."""
    gdb = gdb_or_fail()
    p, _log = start_target(tmp_path)
    marker = tmp_path / "ran"
    good = ("open(%r, 'w').write('good')\n" % str(marker)).encode()
    (tmp_path / "run").mkdir()
    path = write_probe(tmp_path / "run", good)
    try:
        assert inject.inject(gdb, p.pid, inject.bootstrap(str(path), hashlib.sha256(good).hexdigest(), len(good),
                                                          os.geteuid()))[0]
        wait_for(marker.exists, what="the probe file to run")
    finally:
        stop(tmp_path)
        p.wait(30)
    assert marker.read_text() == "good"


def test_a_probe_error_restores_and_never_reaches_the_caller(tmp_path):
    """The probe's own failure (here: its record() raises) detaches it; the target sees nothing."""
    gdb = gdb_or_fail()
    p, log = start_target(tmp_path)
    try:
        head = 'def record(target, role, function, loc, caller=None):\n'
        data = render(tmp_path / "run", ttl=60.0, plant=(head, head + '    raise RuntimeError("probe bug")\n'))
        path = write_probe(tmp_path / "run", data)
        assert inject.inject(gdb, p.pid, inject.bootstrap(str(path), hashlib.sha256(data).hexdigest(), len(data),
                                                          os.geteuid()))[0]
        det = wait_for(lambda: [r for r in records(tmp_path / "run") if r["event"] == "detached"], what="detached")
    finally:
        stop(tmp_path)
        p.wait(30)
    assert det[0]["reason"] == "probe error" and "probe bug" in det[0]["error"] and det[0]["still_wrapped"] == []
    assert json.loads(log.read_text().splitlines()[-1]) == {"bad": 0, "restored": True, "attached": None}


def test_gdb_is_run_so_it_loads_nothing_of_the_target_users():
    argv = inject.gdb_argv("/usr/bin/gdb", 123, ["print 1"], "/opt/x/lib/libpython3.11.so.1.0")
    assert argv[1:3] == ["-nx", "-nh"]
    early = [argv[i + 1] for i, a in enumerate(argv) if a == "-iex"]
    for s in ("set auto-load off", "set debuginfod enabled off", "set libthread-db-search-path /nonexistent",
              "set auto-solib-add off"):
        assert s in early
    assert argv.index("-p") > max(i for i, a in enumerate(argv) if a == "-iex")  # settled before attaching
    assert "sharedlibrary ^/opt/x/lib/libpython3\\.11\\.so\\.1\\.0$" in argv
    assert inject.CLEAN_ENV["HOME"] == "/nonexistent" and set(inject.CLEAN_ENV) <= {"PATH", "LANG", "LC_ALL",
                                                                                   "HOME", "TERM"}


def test_bootstrap_refuses_a_path_it_cannot_quote():
    with pytest.raises(ValueError):
        inject.bootstrap("/var/tmp/it's/attach-probe.py", "0" * 64, 10)
    code = inject.bootstrap("/var/tmp/r/attach-probe.py", "ab" * 32, 10, 0)
    compile(code, "bootstrap", "exec")
    assert inject.c_string('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'


def test_elf_symbols_of_a_real_interpreter_and_a_non_python():
    assert elf.defined_symbols(PY, ("Py_AddPendingCall", "PyRun_SimpleString", "nope")) == {
        "Py_AddPendingCall", "PyRun_SimpleString"}
    assert elf.defined_symbols("/bin/sleep", ("Py_Initialize", "_PyRuntime")) == set()
    with pytest.raises(elf.ElfError):
        elf.defined_symbols(__file__, ("x",))


def test_interpreter_refusals_name_the_cause(tmp_path):
    sleeper = subprocess.Popen(["/bin/sleep", "20"])
    try:
        msg = checks.interpreter_refusals({"pid": sleeper.pid, "comm": "sleep", "exe": "/bin/sleep"})
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(msg) == 1 and "is not a CPython" in msg[0] and "--method patch --yes" in msg[0]


def test_gdb_output_is_read_as_what_happened():
    assert inject.interpret(0, "$1 = 0\n", "") == (True, "queued")
    assert not inject.interpret(0, "$1 = -1\n", "")[0]
    ok, why = inject.interpret(1, "", "ptrace: Operation not permitted.\n")
    assert not ok and why.startswith("ptrace refused")
    ok, why = inject.interpret(1, "", 'No symbol "Py_AddPendingCall" in current context.\n')
    assert not ok and "C-API symbols" in why


def test_ptrace_refused_by_seccomp_is_named_before_anything_changes(tmp_path):
    """The agent under a seccomp filter that refuses ptrace (tests/support/no_ptrace.py): the live check
    (gdb against a child of its own) names seccomp and the restart-based fix."""
    gdb = gdb_or_fail()
    code = ("import json,sys; sys.path.insert(0, %r); from mla_doctor.agent.attach import checks; "
            "print(json.dumps(checks.ptrace_refusals([0], %r)))" % (str(Path(__file__).parents[2]), gdb))
    p = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "support" / "no_ptrace.py"), sys.executable,
                        "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out) == 1 and "seccomp" in out[0] and "--method patch --yes" in out[0]
    # and without the filter the same check passes
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert json.loads(p.stdout) == []


def test_ptrace_without_cap_sys_ptrace_against_another_user_is_refused():
    """The agent without CAP_SYS_PTRACE (setpriv drops it; a container without SYS_PTRACE) and a server of
    another uid: refused, naming the capability."""
    gdb = gdb_or_fail()
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("needs root and setpriv (util-linux) to drop CAP_SYS_PTRACE")
    code = ("import json,sys; sys.path.insert(0, %r); from mla_doctor.agent.attach import checks; "
            "print(json.dumps(checks.ptrace_refusals([65534], %r)))" % (str(Path(__file__).parents[2]), gdb))
    p = subprocess.run(["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", sys.executable, "-c",
                        code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out) == 1 and "CAP_SYS_PTRACE" in out[0] and "SYS_PTRACE" in out[0]


def test_a_test_attach_that_times_out_is_said_to_be_slow_never_a_ptrace_refusal(tmp_path, monkeypatch):
    # a loaded host: gdb's test attach to the agent's own child does not finish in time. That is not a ptrace
    # refusal (which would send the operator to change capabilities or seccomp for nothing): say it was slow
    if os.geteuid() != 0:
        pytest.fail("needs root: the test attach runs only after the agent's own capability check")
    slow = tmp_path / "gdb"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(checks, "GDB_TIMEOUT", 1.0)
    (why,) = checks.ptrace_refusals([os.geteuid()], str(slow))
    assert "did not finish a test attach" in why and "overloaded" in why, why
    assert "ptrace is refused" not in why and "--method patch --yes" in why


def _inject_survives(gdb: str, tmp: Path) -> bool:
    """Ground truth, independent of inject.self_test: gdb queues real code into a real CPython that calls the
    stand-in entries; True when the code ran and the process went on to finish its loop without a wrong result."""
    p, log = start_target(tmp, seconds=120)
    marker = tmp / "ran"
    try:
        ok, _ = inject.inject(gdb, p.pid, "open(%r, 'w').close()" % str(marker))
        try:
            wait_for(marker.exists, timeout=20, what="the injected code")
        except AssertionError:
            pass
        alive = p.poll() is None
        stop(tmp)
        p.wait(timeout=60)
        tail = log.read_text().splitlines()[-1]
        return bool(ok and alive and marker.exists() and p.returncode == 0 and json.loads(tail)["bad"] == 0)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_attach_uses_only_a_gdb_whose_injected_call_leaves_the_process_running(tmp_path):
    """gdb 13 on a CPU with AMX cannot write the register state back after a call (it said "Couldn't write extended
    state status: Bad address") and the process it called into died: on a server that would be the production
    outage this tool must never cause. The agent tries each trusted gdb on a throwaway process first; here every
    gdb it turned down really kills a CPython it injects into, and the one it chose really does not."""
    chosen, unfit = inject.choose_gdb()
    assert chosen is not None, "no usable gdb: %s (python3 tools/ensure_gdb.py installs one as root)" % unfit
    (tmp_path / "chosen").mkdir()
    assert _inject_survives(chosen, tmp_path / "chosen"), "%s was chosen but its injected call failed" % chosen
    for i, gdb in enumerate(g for g in inject.trusted_gdbs() if g != chosen and
                            any(u.startswith(g + ":") for u in unfit)):
        d = tmp_path / ("unfit%d" % i)
        d.mkdir()
        assert not _inject_survives(gdb, d), "%s was turned down (%s) but an injected call left the process " \
                                             "running" % (gdb, unfit)


def test_a_gdb_that_kills_what_it_calls_into_is_refused_before_attach(monkeypatch):
    """The refusal names each gdb and why, and the fix, before anything changes (ops.check returns no gdb)."""
    from mla_doctor.agent.attach import ops
    monkeypatch.setattr(inject, "_CHOSEN", {"gdb": (None, ["/usr/bin/gdb: an injected call into a throwaway "
                                                             "process killed it (gdb exit 1: Couldn't write "
                                                             "extended state status: Bad address.)"])})
    monkeypatch.setattr(ops.procs, "identify_server", lambda pid: {"pid": pid})
    monkeypatch.setattr(ops.procs, "model_processes", lambda pid, vdir: [{"pid": pid, "tracer_pid": 0}])
    server, found, gdb, problems = ops.check({"pid": os.getpid(), "vllm_dir": "/nonexistent"})
    assert gdb is None and len(problems) == 1
    assert "/usr/bin/gdb" in problems[0] and "extended state" in problems[0] and "--method patch" in problems[0]


def test_the_restore_never_puts_the_original_back_over_someone_else_s_replacement(tmp_path):
    """Between the wrap and the detach the process itself replaces a wrapped attribute (a hot patch, another
    tool): the detach leaves that replacement in place and reports the attribute as still not the original."""
    gdb = gdb_or_fail()
    p, log = start_target(tmp_path)
    run = tmp_path / "run"
    marker = tmp_path / "theirs"
    try:
        data = render(run, ttl=60.0)
        path = write_probe(run, data)
        code = inject.bootstrap(str(path), hashlib.sha256(data).hexdigest(), len(data), os.geteuid())
        assert inject.inject(gdb, p.pid, code)[0]
        wait_for(lambda: any(r["event"] == "attached" for r in records(run)), what="attached")
        replace = ("import fakemla\n"
                   "def theirs(self, q, *a):\n return ('mqa', len(q))\n"
                   "theirs.theirs = True\n"
                   "fakemla.MLACommonImpl.forward_mqa = theirs\n"
                   "open(%r, 'w').close()\n" % str(tmp_path / "replaced"))
        assert inject.inject(gdb, p.pid, replace)[0]
        wait_for((tmp_path / "replaced").exists, what="the replacement to run")
        (run / "lease.json").write_text(json.dumps({"expires": 1, "ttl": 0, "epoch": 0, "detach": True}))
        det = wait_for(lambda: [r for r in records(run) if r["event"] == "detached"], what="detached")[0]
        look = ("import fakemla\n"
                "open(%r, 'w').write(str(getattr(fakemla.MLACommonImpl.__dict__['forward_mqa'], 'theirs', False)))\n"
                % str(marker))
        assert inject.inject(gdb, p.pid, look)[0]
        wait_for(marker.exists, what="the look at the class")
    finally:
        stop(tmp_path)
        p.wait(30)
    assert marker.read_text() == "True"  # their replacement kept, never the original put back over it
    assert det["still_wrapped"] == ["MLACommonImpl.forward_mqa"] and det["restored"] == 1
    assert json.loads(log.read_text().splitlines()[-1])["bad"] == 0
