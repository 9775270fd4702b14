"""The rolling scheduler (pure) and the threaded fleet runner around it."""
from __future__ import annotations

import random
import threading
import time

import pytest

from mla_doctor.exit_codes import ExitStatus
from mla_doctor.fleet.scheduler import Scheduler, Undo, job_failed, run_fleet
from mla_doctor.results import HostReport, HostStatus


def names(n):
    return [f"h{i:02d}" for i in range(1, n + 1)]


def test_never_more_than_limit_running_and_order_kept():
    s = Scheduler(names(5), limit=2)
    assert [s.next(), s.next(), s.next()] == ["h01", "h02", None]
    s.finish("h02", failed=False)
    assert s.next() == "h03" and s.next() is None
    for h in ("h01", "h03"):
        s.finish(h, False)
    assert [s.next(), s.next(), s.next()] == ["h04", "h05", None]
    s.finish("h04", False)
    s.finish("h05", False)
    assert s.done and s.peak == 2 and s.not_run == [] and not s.stopped


@pytest.mark.parametrize("seed", range(20))
def test_random_completion_orders_respect_the_limit(seed):
    rnd = random.Random(seed)
    limit = rnd.randint(1, 4)
    s = Scheduler(names(rnd.randint(1, 30)), limit=limit)
    while not s.done:
        while s.next() is not None:
            pass
        assert 1 <= len(s.running) <= limit
        s.finish(rnd.choice(sorted(s.running)), failed=False)
    assert len(s.finished) == s.total and s.peak <= limit


def test_stops_when_failures_exceed_the_percentage():
    s = Scheduler(names(10), limit=2, max_fail_percent=10)
    a, b = s.next(), s.next()
    s.finish(a, failed=True)  # 1/10 = 10%: not more than 10
    assert not s.stopped and s.next() == "h03"
    s.finish(b, failed=True)  # 2/10 = 20% > 10: stop handing out
    assert s.stopped and s.next() is None and not s.done  # h03 still running
    s.finish("h03", failed=False)
    assert s.done and s.not_run == names(10)[3:]


def test_zero_percent_stops_at_the_first_failure_and_none_never_stops():
    s = Scheduler(names(3), limit=1, max_fail_percent=0)
    s.finish(s.next(), failed=True)
    assert s.stopped and s.done and s.not_run == ["h02", "h03"]
    s = Scheduler(names(3), limit=1, max_fail_percent=None)
    while not s.done:
        s.finish(s.next(), failed=True)
    assert s.failed == names(3) and s.not_run == []


def test_bad_limit_and_empty_fleet():
    with pytest.raises(ValueError):
        Scheduler(["a"], limit=0)
    assert Scheduler([], limit=3).done


def _ok(host):
    return HostReport(host=host)


def test_runner_bounds_real_concurrency_and_survives_a_crashing_host():
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    # the first three wait for each other (an event, not a sleep that a loaded machine may outlast: a job done
    # before the third had started would make the peak 2); the runner must never let a fourth in meanwhile
    first = threading.Barrier(3, timeout=60)

    def job(host, cancel, step):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        step("working")
        if host in names(3):
            first.wait()
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        if host == "h03":
            raise RuntimeError("boom")
        return _ok(host)

    steps = []
    from mla_doctor.fleet.scheduler import Events

    results, sched = run_fleet(names(9), job, limit=3, events=Events(step=lambda h, m: steps.append(h)))
    assert state["peak"] == 3 == sched.peak
    assert results["h03"].status == HostStatus.ERROR and "boom" in results["h03"].error
    assert all(results[h].status == HostStatus.OK for h in names(9) if h != "h03")
    assert sorted(steps) == names(9)


def test_runner_times_out_a_stuck_host_and_closes_its_connection():
    closed = threading.Event()

    class FakeTransport:
        def close(self):
            closed.set()

    def job(host, cancel, step):
        if host == "h02":
            cancel.attach(FakeTransport())
            closed.wait(60)  # blocked until the runner closes the connection
            return _ok(host)
        return _ok(host)

    t0 = time.monotonic()
    results, _ = run_fleet(names(3), job, limit=3, timeout_for=lambda h: 0.3)
    assert time.monotonic() - t0 < 30  # generous for a loaded machine: the bug waits the job's 60 s out
    assert closed.is_set()
    assert results["h02"].error_kind == "HostTimeout" and "timed out" in results["h02"].error
    assert results["h01"].status == HostStatus.OK and results["h03"].status == HostStatus.OK


def test_ctrl_c_whose_restore_raises_ends_the_host_not_restored():
    """An interrupted fleet: the host's job left a change, putting it back raised. The host must say so (exit
    NOT_RESTORED), never pass as an ordinary interrupted host."""
    import _thread

    closed = threading.Event()

    class FakeTransport:
        def close(self):
            closed.set()

    def job(host, cancel, step):
        cancel.attach(FakeTransport())
        _thread.interrupt_main()  # Ctrl-C while the job runs, connected
        closed.wait(30)  # the interrupt closes the job's connection
        return HostReport(host=host, status=HostStatus.ERROR, error="connection closed")

    def restore(h, report, cancel, step):
        raise RuntimeError("revert blew up")

    undo = Undo(needed=lambda h, r: True, restore=restore, left=lambda h, r: f"{h}: run r1 left", bound_s=10.0)
    results, sched = run_fleet(["h1"], job, limit=1, undo=undo)
    r = results["h1"]
    assert closed.is_set() and sched.interrupted
    assert r.exit_status() == ExitStatus.NOT_RESTORED, (r.error_kind, r.error)
    assert r.error_kind == "NotRestored" and "revert blew up" in r.error


def test_runner_max_fail_percent_reports_the_rest_as_not_run():
    def job(host, cancel, step):
        return HostReport(host=host, status=HostStatus.UNREACHABLE, error="down")

    results, sched = run_fleet(names(5), job, limit=1, max_fail_percent=20)
    # 1/5 = 20% is allowed; the second failure (40%) stops the rollout
    assert [h for h in names(5) if results[h].status == HostStatus.UNREACHABLE] == ["h01", "h02"]
    assert [h for h in names(5) if results[h].error_kind == "NotRun"] == ["h03", "h04", "h05"]
    assert sched.stopped and all(job_failed(results[h]) for h in names(5))


def test_host_job_runs_steps_in_order_on_one_transport_and_stops_at_a_failure(monkeypatch, tmp_path):
    """execute_host with a local transport: command steps, their records, the first failure ends the host."""
    from mla_doctor.fleet import job as fleet
    from mla_doctor.fleet import playbook as pb_mod
    from mla_doctor.fleet.inventory import Host
    from mla_doctor.ssh.transport import ConnectOptions, LocalTransport

    opened = []

    def fake_open(target, conn):
        opened.append((target, conn.user, conn.port, conn.sudo))
        return LocalTransport()

    from mla_doctor.ssh import transport as ssh_transport

    monkeypatch.setattr(ssh_transport, "open_transport", fake_open)  # what host.target.connect opens
    book = tmp_path / "b.yaml"
    book.write_text("""
steps:
  - {name: first, command: "echo hello {{ host }}"}
  - {name: breaks, command: {run: "echo oops >&2; exit 3", expect_rc: 0}}
  - {name: never, command: "touch %s"}
""" % (tmp_path / "never-ran"))
    host = Host(name="h1", vars={"address": "10.9.9.9", "user": "ops", "port": 2222}, groups=["g"])
    plan = pb_mod.plan(pb_mod.load(str(book)), host)
    r = fleet.execute_host(plan, ConnectOptions(user="cli-user", sudo=True))
    assert opened == [("10.9.9.9", "ops", 2222, True)]  # inventory vars win, CLI fills the rest
    assert [(s["name"], s["status"]) for s in r.steps] == [("first", "ok"), ("breaks", "failed")]
    assert r.steps[0]["detail"] == "exit 0: hello h1"
    assert r.error_kind == "CommandFailed" and "exited 3" in r.error and "oops" in r.error
    assert not (tmp_path / "never-ran").exists()
    assert r.transport["executions"] == 2 and r.exit_status() == 4 and r.groups == ["g"]
