"""The node side of attach into a container (agent/attach/container.py), on real mount namespaces: a process
started in a mount namespace of its own (`unshare -m`, as a container runtime makes one) stands for the
container. The bind of the node's run directory, its removal, and each refusal said before anything changes --
all real kernel calls, no runtime needed (the docker end-to-end is test_live_attach_container.py).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from mla_doctor.agent.attach import container

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and mounts need root")


class Contained:
    """A sleeping process in its own mount namespace; `setup` is sh run inside it first (its own mounts)."""

    def __init__(self, setup: str):
        self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                      setup + "\nexec sleep 300"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the exec: then its setup is done
            try:
                if Path(f"/proc/{self.proc.pid}/comm").read_text().strip() == "sleep":
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError(self.proc.stderr.read() if self.proc.poll() is not None else "no sleep")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def path(self, p: str) -> Path:
        return Path(f"/proc/{self.pid}/root{p}")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def tmpfs_container():
    c = Contained("mount -t tmpfs -o mode=1777 none /dev/shm")
    yield c
    c.stop()


def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs" / "r1"
    (d / "records").mkdir(parents=True)
    (d / "lease.json").write_text('{"expires": 0}')
    return d


def test_not_a_container_for_a_process_of_the_agents_namespace():
    assert container.in_container(os.getpid()) is False


def test_the_run_directory_is_bound_into_the_container_and_taken_out_again(tmpfs_container, tmp_path):
    c, rd = tmpfs_container, run_dir(tmp_path)
    assert container.in_container(c.pid)
    facts = container.inspect(c.pid)
    assert facts["refused"] == [] and facts["place"] == "/dev/shm" and facts["root_uid_inside"] == 0
    seen = container.mount_run_dir(c.pid, str(rd), facts["place"], "r1")
    assert seen == "/dev/shm/mla-doctor-r1"
    assert c.path(seen + "/lease.json").read_text() == '{"expires": 0}'  # the node's own file, seen inside
    (rd / "records" / "probe-1.jsonl").write_text("x")
    assert c.path(seen + "/records/probe-1.jsonl").read_text() == "x"
    assert not Path(seen).exists()  # in the container's namespace only
    info = {"pid": c.pid, "mnt_ns": facts["mnt_ns"], "dir": seen}
    assert container.left_in(info) is True
    assert container.unmount_run_dir(info) == "unmounted, removed"
    assert container.left_in(info) is False and os.listdir(c.path("/dev/shm")) == []
    assert (rd / "records" / "probe-1.jsonl").read_text() == "x"  # the node's run directory untouched
    assert container.unmount_run_dir(info) == "nothing left"  # twice: a watchdog after a detach


def test_a_planted_link_where_the_directory_goes_is_refused_and_not_followed(tmpfs_container, tmp_path):
    c, rd = tmpfs_container, run_dir(tmp_path)
    target = tmp_path / "victim"
    target.mkdir()
    os.symlink(str(target), str(c.path("/dev/shm/mla-doctor-r1")))  # the container's root plants it first
    with pytest.raises(OSError):
        container.mount_run_dir(c.pid, str(rd), "/dev/shm", "r1")
    assert os.path.islink(c.path("/dev/shm/mla-doctor-r1")) and os.listdir(target) == []
    assert not os.path.ismount(target)


def test_a_container_without_a_writable_place_is_refused_before_anything_changes(tmp_path):
    setup = "; ".join(f"mount -t tmpfs -o ro none {shlex.quote(p)}" for p in container.PLACES)
    c = Contained(setup)
    try:
        facts = container.inspect(c.pid)
        assert "place" not in facts
        why = " ".join(facts["refused"])
        assert "no writable place" in why and all(f"{p} on a read-only mount" in why for p in container.PLACES)
    finally:
        c.stop()


def test_a_place_that_is_a_link_in_the_container_is_not_used(tmp_path):
    # /dev/shm a link to the node's-looking /tmp: inside the container it is just a link: never taken
    c = Contained("mount -t tmpfs none /dev; ln -s /tmp /dev/shm; mount -t tmpfs -o ro none /tmp; "
                  "mount -t tmpfs none /var/tmp")
    try:
        facts = container.inspect(c.pid)
        assert facts["place"] == "/var/tmp"
        assert dict(facts["places"])["/dev/shm"].startswith("not a directory")
    finally:
        c.stop()


def test_the_node_root_as_seen_in_a_user_namespace():
    p = subprocess.Popen(["unshare", "-U", "-m", "--map-root-user", "sleep", "30"], stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        # the node's root is not mapped there: a file of it reads as the overflow uid inside; the inside root is
        # the node's root mapped (map-root-user maps inside 0 to the caller, here root)
        assert container.inside_uid(p.pid, 0) == 0
        assert container.inside_uid(p.pid, 4242) == container.overflow_uid()
    finally:
        p.kill()
        p.wait()


def test_a_process_in_its_own_pid_namespace_is_named_by_both_pids(tmp_path):
    from mla_doctor.agent.attach import closing, procs

    p = subprocess.Popen(["unshare", "-p", "-f", "--kill-child", "sleep", "30"], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        kids = []
        while not kids and time.monotonic() < deadline:
            kids = procs.children_of(p.pid)
            time.sleep(0.02)
        d = procs.describe(kids[0])
        assert d["pid"] == kids[0] and d["ns_pid"] == 1  # what its os.getpid() says, and so its probe's records
        # the run's records name it by that pid: the node's proof names it by the host pid, and nothing else counts
        from mla_doctor.agent import fs

        root = str(tmp_path / "rr")
        fs.register_root(root)
        fs.make_run_root(root)
        rd = Path(fs.run_dir_of(root, "r1"))
        fs.make_run_dirs(root, str(rd), (0, 0))
        fs.write_json(fs.manifest_path(str(rd)), {"container": {"dir": "/dev/shm/x"}, "processes": [
            {"pid": kids[0], "ns_pid": 1}]})
        (rd / "records" / "probe-1.jsonl").write_text(
            json.dumps({"event": "attached", "pid": 1}) + "\n" + json.dumps({"event": "detached", "pid": 1}) + "\n"
            + json.dumps({"event": "attached", "pid": 7}) + "\n")
        det, att = closing.detached_records(str(rd))
        assert set(att) == {kids[0]} and set(det) == {kids[0]}
    finally:
        p.kill()
        p.wait()


def test_a_mount_namespace_owned_by_a_user_namespace_takes_the_bind_too(tmp_path):
    """A rootless container's mount namespace belongs to its user namespace: the node's root (all capabilities
    there) binds the run directory in and takes it out the same way."""
    p = subprocess.Popen(["unshare", "-U", "-m", "--map-root-user", "--propagation", "private", "sh", "-c",
                          "mount -t tmpfs none /dev/shm && exec sleep 60"], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert Path(f"/proc/{p.pid}/ns/user").stat().st_ino != Path("/proc/self/ns/user").stat().st_ino
        rd = run_dir(tmp_path)
        facts = container.inspect(p.pid)
        seen = container.mount_run_dir(p.pid, str(rd), facts["place"], "r1")
        assert Path(f"/proc/{p.pid}/root{seen}/lease.json").read_text() == '{"expires": 0}'
        info = {"pid": p.pid, "mnt_ns": facts["mnt_ns"], "dir": seen}
        assert container.unmount_run_dir(info) == "unmounted, removed" and container.left_in(info) is False
    finally:
        p.kill()
        p.wait()
