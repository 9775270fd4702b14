"""A node process's cgroup path -> the container it proposes (runtime, id, pod uid, rootless user), over the
shapes real nodes print (from runtime issue threads: runc#4620's CRI-O v1 hybrid, cadvisor/netdata k8s trees,
opentelemetry-java#4507's cri-containerd colon form, podman's rootless user@UID.service, minikube's nested
/docker/<id>/kubepods.slice), and the Kubernetes restart refusal's wording. Pure logic: the real runtimes are in
tests/integration/test_container_runtimes.py."""
from __future__ import annotations

import os

from mla_doctor.agent.facts import containers as C

ID = "d0b3604b67ac7930dd34ba3a796627e3e4717d12309e90a4afe3f38b6816ac98"
ID2 = "5eed917563583925ffdbd40a64efb2aaffe58638e57add8becaf460fe74f5b1c"
POD = "a5c1f8d5_1919_434d_add7_4afaafdaef89"
POD_DASH = POD.replace("_", "-")


def one(text):
    got = C.parse_cgroup(text)
    assert len(got) == 1, got
    return got[0]


def test_docker_systemd_driver_v2():
    m = one("0::/system.slice/docker-%s.scope\n" % ID)
    assert (m.runtime, m.id, m.kubernetes, m.pod_uid) == ("docker", ID, False, None)


def test_docker_cgroupfs_driver_v1_hybrid():
    text = "12:pids:/docker/%s\n11:memory:/docker/%s\n1:name=systemd:/docker/%s\n0::/\n" % (ID, ID, ID)
    m = one(text)
    assert (m.runtime, m.id) == ("docker", ID)


def test_podman_rootful_with_its_container_subgroup():
    m = one("0::/machine.slice/libpod-%s.scope/container\n" % ID)
    assert (m.runtime, m.id, m.rootless_uid) == ("podman", ID, None)


def test_podman_rootless_under_the_users_manager():
    m = one("0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-%s.scope\n" % ID)
    assert (m.runtime, m.id, m.rootless_uid) == ("podman", ID, 1000)


def test_podman_conmon_is_not_the_container():
    assert C.parse_cgroup("0::/machine.slice/libpod-conmon-%s.scope\n" % ID) == []
    assert C.parse_cgroup("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod%s.slice/"
                          "crio-conmon-%s.scope\n" % (POD, ID)) == []


def test_containerd_kubernetes_systemd_driver():
    m = one("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod%s.slice/cri-containerd-%s.scope\n"
            % (POD, ID))
    assert (m.runtime, m.id, m.kubernetes, m.pod_uid) == ("containerd", ID, True, POD_DASH)


def test_containerd_kubernetes_colon_form_v1():
    m = one("11:perf_event:/kubepods-besteffort-pod%s.slice:cri-containerd:%s\n" % (POD, ID))
    assert (m.runtime, m.id, m.kubernetes) == ("containerd", ID, True)


def test_kubernetes_cgroupfs_driver_names_no_runtime():
    m = one("0::/kubepods/burstable/pod%s/%s\n" % (POD_DASH, ID))
    assert (m.runtime, m.id, m.kubernetes, m.pod_uid) == (None, ID, True, POD_DASH)
    m = one("0::/kubepods/pod%s/%s\n" % (POD_DASH, ID))  # guaranteed QoS: no class directory
    assert (m.id, m.pod_uid) == (ID, POD_DASH)


def test_crio_v1_hybrid():
    lines = ["13:freezer:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod%s.slice/crio-%s.scope"
             % (POD, ID2), "11:files:/", "1:name=systemd:/kubepods.slice/kubepods-burstable.slice/"
             "kubepods-burstable-pod%s.slice/crio-%s.scope" % (POD, ID2)]
    m = one("\n".join(lines))
    assert (m.runtime, m.id, m.kubernetes, m.pod_uid) == ("cri-o", ID2, True, POD_DASH)


def test_ctr_run_default_cgroupfs_path():
    m = one("0::/k8s.io/vllm-ctr\n")
    assert (m.runtime, m.id, m.ns, m.kubernetes) == ("containerd", "vllm-ctr", "k8s.io", False)


def test_plain_processes_propose_nothing():
    for text in ("0::/\n", "0::/system.slice/ssh.service\n", "0::/user.slice/user-1000.slice/session-3.scope\n",
                 "0::/init.scope\n"):
        assert C.parse_cgroup(text) == [], text
    # any two-level path may be ctr's /<namespace>/<id>: only proposed; containerd's state on the node decides
    m = one("4:memory:/process_api/3d7f395eeb180a5cf00a09ce7500a98b\n0::/\n")
    assert (m.runtime, m.ns) == ("containerd", "process_api")


def test_nested_outermost_first_and_a_forged_inner_name_comes_after():
    # minikube/kind: a docker container that is itself a Kubernetes node
    got = C.parse_cgroup("0::/docker/%s/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod%s.slice/"
                         "crio-%s.scope\n" % (ID, POD, ID2))
    assert [(m.runtime, m.id) for m in got] == [("docker", ID), ("cri-o", ID2)]
    # a container process that made a sub-cgroup named like another runtime's container: the real one is first
    got = C.parse_cgroup("0::/system.slice/docker-%s.scope/cri-containerd-%s.scope\n" % (ID, ID2))
    assert [m.id for m in got] == [ID, ID2]
    chosen, _ = C.pick(got, lambda m: m.id == ID)
    assert chosen.id == ID


def test_unified_line_read_before_v1_hierarchies():
    got = C.parse_cgroup("5:pids:/docker/%s\n0::/system.slice/docker-%s.scope\n" % (ID2, ID))
    assert [m.id for m in got] == [ID, ID2]


def test_kubernetes_names_from_labels_or_cri_annotations():
    assert C.kubernetes_names({"io.kubernetes.pod.name": "vllm-0", "io.kubernetes.pod.namespace": "ml",
                               "io.kubernetes.container.name": "server"})[:3] == ("vllm-0", "ml", "server")
    assert C.kubernetes_names({"io.kubernetes.cri.sandbox-name": "vllm-0", "io.kubernetes.cri.sandbox-namespace":
                               "ml", "io.kubernetes.cri.container-name": "server",
                               "io.kubernetes.cri.sandbox-uid": POD_DASH}) == ("vllm-0", "ml", "server", POD_DASH)
    assert C.kubernetes_names({}) == (None, None, None, None)


def test_kubernetes_restart_refusal_names_the_pod_and_points_to_attach():
    ref = C.ContainerRef(runtime="containerd", id=ID, root_pid=10, uid=0, gid=0, name=ID, pod="vllm-0",
                         namespace="ml", container="server", kubernetes=True, runtime_namespace="k8s.io")
    why = C.kubernetes_restart_refusal(ref)
    assert "pod ml/vllm-0" in why and "controller" in why and "--method attach" in why
    assert "containerd container %s (pod ml/vllm-0, container server)" % ID[:12] in why
    plain = C.ContainerRef(runtime="docker", id=ID, root_pid=10, uid=0, gid=0, name="vllm")
    assert C.kubernetes_restart_refusal(plain) is None
    assert plain.label() == "docker container vllm"


def test_owns_this_process_itself():
    me = os.getpid()
    assert C.owns(me, me) and C.owns(1, me) is C.same_mount_ns(1, me)
    assert not C.owns(me, 1)


# --- the runtimes' records, on real files laid out as the runtimes lay them out (a tmp tree, root's) -------------

def _write(path, text, owner_below=None, uid=None):
    """Write path; with owner_below, every component under that directory (never it or above) owned by uid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if owner_below is not None:
        rel = path.relative_to(owner_below)
        for i in range(1, len(rel.parts) + 1):
            os.chown(owner_below.joinpath(*rel.parts[:i]), uid, uid)


def test_containerd_task_records_every_namespace(tmp_path):
    tasks = tmp_path / "tasks"
    _write(tasks / "k8s.io" / ID / "init.pid", str(os.getpid()))
    _write(tasks / "k8s.io" / ID / "config.json", '{"annotations": {"io.kubernetes.cri.sandbox-name": "vllm-0", '
           '"io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.container-name": "server"}}')
    _write(tasks / "default" / "my-ctr" / "init.pid", "1")
    got = sorted(C.containerd_records(tasks=(str(tasks),)), key=lambda r: r.ns)
    assert [(r.ns, r.id, r.root_pid) for r in got] == [("default", "my-ctr", 1), ("k8s.io", ID, os.getpid())]
    rec = C.annotated(got[1])
    assert C.kubernetes_names(rec.annotations)[:3] == ("vllm-0", "ml", "server")
    assert C._verified(rec, os.getpid())
    assert [r.id for r in C.containerd_records(ID, tasks=(str(tasks),))] == [ID]


def test_containerd_records_never_through_a_link_or_a_tree_root_does_not_own(tmp_path):
    tasks = tmp_path / "tasks"
    _write(tmp_path / "elsewhere" / ID / "init.pid", str(os.getpid()))
    tasks.mkdir()
    (tasks / "k8s.io").symlink_to(tmp_path / "elsewhere")
    assert list(C.containerd_records(tasks=(str(tasks),))) == []
    other = tmp_path / "other"
    _write(other / "k8s.io" / ID / "init.pid", str(os.getpid()))
    os.chown(other, 65534, 65534)
    assert list(C.containerd_records(tasks=(str(other),))) == []


def test_storage_records_podman_and_crio_told_apart_by_annotations(tmp_path):
    rr = tmp_path / "storage"
    _write(rr / "overlay-containers" / ID / "userdata" / "pidfile", str(os.getpid()))
    _write(rr / "overlay-containers" / ID2 / "userdata" / "pidfile", str(os.getpid()))
    _write(rr / "overlay-containers" / ID2 / "userdata" / "config.json",
           '{"annotations": {"io.kubernetes.cri-o.ContainerID": "%s", "io.kubernetes.pod.name": "p", '
           '"io.kubernetes.pod.namespace": "n", "io.kubernetes.container.name": "c"}}' % ID2)
    got = {r.id: C.annotated(r) for r in C.storage_records(runroots=(str(rr),), users=str(tmp_path / "none"))}
    assert got[ID].runtime == "podman" and got[ID2].runtime == "cri-o"
    assert C.kubernetes_names(got[ID2].annotations)[:3] == ("p", "n", "c")


def test_a_rootless_users_pidfile_cannot_claim_a_process_outside_its_user_namespace(tmp_path):
    users = tmp_path / "user"
    _write(users / "1000" / "containers" / "overlay-containers" / ID / "userdata" / "pidfile", str(os.getpid()),
           owner_below=users, uid=1000)
    recs = list(C.storage_records(runroots=(), users=str(users)))
    assert [(r.id, r.rootless_uid) for r in recs] == [(ID, 1000)]
    # this test's own process runs as root in the node's user namespace: not that user's container
    assert C.owns(recs[0].root_pid, os.getpid()) and not C._verified(recs[0], os.getpid())
    # a run directory another user owns is not that uid's: not read at all
    os.chown(users / "1000", 1001, 1001)
    assert list(C.storage_records(runroots=(), users=str(users))) == []


def test_resolve_refuses_names_no_runtime_takes_before_asking_any():
    for bad in ("", "../etc", "a b", "x;reboot", "-rf", "/abs"):
        try:
            C.resolve(bad)
        except C.Refusal as e:
            assert "not a container name" in str(e)
        else:
            raise AssertionError(bad)


def test_docker_runtime_refuses_a_kubelets_container_before_anything_changes():
    from mla_doctor.host.live import refusals

    pod = {"name": "k8s_vllm_vllm-0_ml_uid_0", "kubernetes": {"io.kubernetes.pod.name": "vllm-0",
                                                              "io.kubernetes.pod.namespace": "ml",
                                                              "io.kubernetes.container.name": "vllm"}}
    try:
        refusals.check_not_kubernetes(pod)
    except refusals.HostRefusal as r:
        assert r.kind == "WrongRuntime" and "pod ml/vllm-0 (container vllm)" in r.message
        assert "controller" in r.message and "--method attach" in r.message
    else:
        raise AssertionError("not refused")
    refusals.check_not_kubernetes({"name": "vllm", "kubernetes": {}})
    refusals.check_not_kubernetes({"name": "vllm"})  # an older agent's answer: no labels read
