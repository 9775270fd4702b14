"""Which container `run --runtime docker` diagnoses (agent/runtimes/docker.py proven_containers): only one in
which identify() proves a vLLM server (the process holding its own port's listening socket, its install its
own); a container where a process merely looks like one (its argv; a mapping of vLLM's world-readable .so)
is never chosen and is listed with why. The facts are find_servers()'s shape; identify() runs for real on
them (the install's owner read from a real directory through /proc/PID/root)."""
from __future__ import annotations

import os

from mla_doctor.agent.runtimes import docker


def _cand(pid, cid, vdir, listening, port=8000, foreign=None):
    return {"pid": pid, "uid": 0, "user": "root", "argv": ["vllm", "serve", "m"], "port": port,
            "port_from": "--port", "listening_ports": listening,
            "supervisor": {"kind": "docker", "container": cid, "runtime": "docker"},
            "install": {"vllm_dir": None if foreign else vdir, "foreign_mapped": foreign, "prefix": "/usr"}}


def test_a_look_alike_container_is_never_chosen_and_is_listed(tmp_path):
    vdir = tmp_path / "vllm"
    vdir.mkdir()
    me = os.getpid()
    cands = [_cand(me, "real" * 16, str(vdir), [8000]),
             _cand(os.getppid(), "quiet" * 12, str(vdir), []),  # looks like vLLM, listens on nothing
             _cand(1, "mmap" * 16, str(vdir), [9000], port=9000, foreign=["/opt/v/vllm/_C.abi3.so"])]
    seen, unproven = docker.proven_containers(cands)
    assert seen == {"real" * 16: [me]}
    why = {u["id"]: u["why"] for u in unproven}
    assert set(why) == {"quiet" * 12, "mmap" * 16}
    assert why["quiet" * 12].startswith("does not listen on port 8000")
    assert "proves nothing" in why["mmap" * 16]


def test_no_proven_server_chooses_no_container(tmp_path):
    seen, unproven = docker.proven_containers([_cand(os.getpid(), "c" * 64, str(tmp_path), [])])
    assert seen == {} and [u["id"] for u in unproven] == ["c" * 64]
