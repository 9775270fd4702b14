"""Which container a node's process runs in, seen from the node as root: the runtime and container id named by
its cgroup path (docker, podman rootful and rootless, containerd with or without Kubernetes, CRI-O), checked
against the runtime's own record of the container's first process, and the names a person knows it by (the
container's name; a Kubernetes pod's name, namespace and container name from the runtime's labels or
annotations). Nothing here trusts a name the container could write: a cgroup path only proposes an id, the
runtime's state on the node decides.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field

from ..common import read_text, run_argv
from ..protocol import Refusal

DOCKER = "docker"
PODMAN = "podman"
CONTAINERD = "containerd"
CRIO = "cri-o"
RUNTIMES = (DOCKER, PODMAN, CONTAINERD, CRIO)

# the labels/annotations a Kubernetes node's runtime puts on a pod's container (kubelet's CRI names)
POD_NAME = "io.kubernetes.pod.name"
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"
# containerd's CRI plugin writes these into the container's OCI spec (config.json), CRI-O its own
CRI_ANNOTATIONS = {
    POD_NAME: ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
    POD_NAMESPACE: ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
    POD_UID: ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"),
    CONTAINER_NAME: ("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
}

_HEX64 = r"[0-9a-f]{64}"
# one cgroup path component that names a container, most specific first; a runtime's monitor process
# (libpod-conmon-<id>.scope, crio-conmon-<id>.scope) is not the container
_SCOPES = (
    (re.compile(r"^cri-containerd-(%s)\.scope$" % _HEX64), CONTAINERD, True),
    (re.compile(r"^crio-(%s)(?:\.scope)?$" % _HEX64), CRIO, True),
    (re.compile(r"^libpod-(%s)(?:\.scope)?$" % _HEX64), PODMAN, False),
    (re.compile(r"^docker-(%s)\.scope$" % _HEX64), DOCKER, False),
)
# the systemd driver's "parent.slice:prefix:id" form, as cgroup v1 hierarchies not managed by systemd show it
_COLON = re.compile(r"^[^:/]+\.slice:(cri-containerd|crio|docker|libpod):(%s)$" % _HEX64)
_COLON_RUNTIME = {"cri-containerd": CONTAINERD, "crio": CRIO, "docker": DOCKER, "libpod": PODMAN}
_POD = re.compile(r"^(?:kubepods-(?:burstable-|besteffort-|guaranteed-)?)?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}"
                  r"[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_ROOTLESS = re.compile(r"^user@(\d+)\.service$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,252}$")  # ids and names a runtime accepts; no '/', no '..'


@dataclass(frozen=True)
class CgroupMatch:
    """A container a cgroup path proposes (not yet checked against the runtime's state)."""

    runtime: str | None  # None: a Kubernetes cgroupfs path, which does not say the runtime
    id: str
    kubernetes: bool = False
    pod_uid: str | None = None
    rootless_uid: int | None = None  # podman run by this user (its user@UID.service)
    ns: str | None = None  # containerd namespace, where the path names one (ctr's cgroupfs /<ns>/<id>)
    path: str = ""


@dataclass
class ContainerRef:
    """One running container, as the node sees it. root_pid is the host pid of the container's first process
    (the runtime's record of it); uid/gid the host ids of the server process in it."""

    runtime: str
    id: str
    root_pid: int
    uid: int
    gid: int
    name: str | None = None  # the runtime's name for it (docker/podman name; containerd: its id)
    pod: str | None = None  # Kubernetes pod name
    namespace: str | None = None  # Kubernetes namespace
    container: str | None = None  # Kubernetes container name
    pod_uid: str | None = None
    kubernetes: bool = False  # managed by a kubelet: its pod's controller would replace a restarted container
    runtime_namespace: str | None = None  # containerd namespace (k8s.io, moby, default)
    rootless_uid: int | None = None  # podman rootless: the user whose podman runs it
    image: str | None = None
    cgroup: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def label(self):
        """How a person names it: 'containerd container 1a2b3c4d5e6f (pod team/vllm-0, container vllm)'."""
        short = self.id[:12] if re.match(r"^[0-9a-f]{64}$", self.id) else self.id
        who = "%s container %s" % (self.runtime, self.name if self.name and self.name != self.id else short)
        if self.pod:
            who += " (pod %s%s, container %s)" % (self.namespace + "/" if self.namespace else "", self.pod,
                                                 self.container or "?")
        if self.rootless_uid is not None:
            who += " (rootless, uid %d)" % self.rootless_uid
        return who

    @classmethod
    def from_json(cls, d):
        """The ContainerRef to_json wrote (its 'label' is derived, not a field)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_json(self):
        return {"runtime": self.runtime, "id": self.id, "root_pid": self.root_pid, "uid": self.uid, "gid": self.gid,
                "name": self.name, "pod": self.pod, "namespace": self.namespace, "container": self.container,
                "pod_uid": self.pod_uid, "kubernetes": self.kubernetes, "runtime_namespace": self.runtime_namespace,
                "rootless_uid": self.rootless_uid, "image": self.image, "cgroup": self.cgroup,
                "labels": dict(self.labels), "label": self.label()}


def _pod_uid(part):
    m = _POD.match(part)
    return m.group(1).replace("_", "-") if m else None


def _match_path(path):
    """The containers one cgroup path proposes, outermost first (a kind node: a docker container holding a
    pod's; a process that made a cgroup named like a container under its own comes after its real one)."""
    parts = [p for p in path.split("/") if p]
    found = []
    pod_uid, rootless, kube = None, None, False
    for i, part in enumerate(parts):
        if part in ("kubepods", "kubepods.slice") or part.startswith("kubepods-"):
            kube = True
        pod_uid = _pod_uid(part) or pod_uid
        m = _ROOTLESS.match(part)
        if m:
            rootless = int(m.group(1))
        hit = None
        for rx, rt, k8s in _SCOPES:
            m = rx.match(part)
            if m:
                hit = (rt, m.group(1), k8s and kube)
                break
        if hit is None:
            m = _COLON.match(part)
            if m:
                hit = (_COLON_RUNTIME[m.group(1)], m.group(2), kube or m.group(1) in ("cri-containerd", "crio"))
        if hit is None and re.match(r"^%s$" % _HEX64, part) and i > 0:
            prev = parts[i - 1]
            if prev == "docker":  # docker's cgroupfs driver: /docker/<id>
                hit = (DOCKER, part, False)
            elif prev == "libpod_parent":  # podman's cgroupfs manager
                hit = (PODMAN, part, False)
            elif kube and pod_uid and _pod_uid(prev):  # kubelet's cgroupfs driver: /kubepods/<qos>/pod<uid>/<id>
                hit = (None, part, True)
        if hit is not None:
            rt, cid, k8s = hit
            found.append(CgroupMatch(runtime=rt, id=cid, kubernetes=bool(k8s or kube), pod_uid=pod_uid if kube
                                     else None, rootless_uid=rootless if rt == PODMAN else None,
                                     path="/" + "/".join(parts[:i + 1])))
    if not found and len(parts) == 2 and not parts[0].endswith((".slice", ".scope", ".service")) \
            and _NAME.match(parts[0]) and _NAME.match(parts[1]):
        # containerd's default cgroupfs path for a task (ctr run): /<namespace>/<id>, any id: the runtime's state
        # decides whether such a container exists
        found.append(CgroupMatch(runtime=CONTAINERD, id=parts[1], kubernetes=False, ns=parts[0],
                                 path="/" + "/".join(parts)))
    return found


def parse_cgroup(text):
    """The containers a /proc/PID/cgroup text proposes, outermost first, one per id: the unified line (0::)
    first, then each v1 hierarchy's (a hybrid host's systemd hierarchy and a runtime's may differ)."""
    lines = []
    for line in (text or "").splitlines():
        hid, _sep, rest = line.partition(":")
        _ctrl, sep, path = rest.partition(":")
        if sep:
            lines.append((hid != "0", path.strip()))
    out, seen = [], set()
    for _v1, path in sorted(lines, key=lambda x: x[0]):
        for m in _match_path(path):
            if m.id not in seen:
                seen.add(m.id)
                out.append(m)
    return out


def cgroup_candidates(pid):
    """parse_cgroup of a live process ([] when its cgroup file cannot be read)."""
    try:
        return parse_cgroup(read_text("/proc/%d/cgroup" % int(pid), 1 << 16))
    except (OSError, ValueError):
        return []


def kubernetes_names(labels):
    """(pod, namespace, container, pod_uid) from a container's labels or OCI annotations (either spelling)."""
    labels = labels or {}

    def one(key):
        for k in CRI_ANNOTATIONS[key]:
            v = labels.get(k)
            if isinstance(v, str) and v:
                return v
        return None

    return one(POD_NAME), one(POD_NAMESPACE), one(CONTAINER_NAME), one(POD_UID)


def kubernetes_restart_refusal(ref):
    """Why a restart method must not touch this container, or None: a kubelet manages it."""
    if ref is None or not (ref.kubernetes or ref.pod):
        return None
    pod = "" if ref.pod else " of a Kubernetes pod%s" % (" (uid %s)" % ref.pod_uid if ref.pod_uid else "")
    return ("the server runs in %s%s: a restart would be undone by the pod's controller, which replaces a "
            "container that stops; use --method attach (no restart)" % (ref.label(), pod))


def same_mount_ns(a, b):
    """Whether two pids share a mount namespace (the runtime's first process and the server)."""
    try:
        return os.readlink("/proc/%d/ns/mnt" % int(a)) == os.readlink("/proc/%d/ns/mnt" % int(b))
    except (OSError, ValueError):
        return False


def ancestors(pid, limit=64):
    """pid and its parents up to the node's init (the parent chain /proc shows)."""
    out, cur = [], int(pid)
    while cur > 0 and len(out) < limit:
        out.append(cur)
        try:
            stat_line = read_text("/proc/%d/stat" % cur, 4096)
            cur = int(stat_line.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def owns(root_pid, pid):
    """The runtime's first process of a container holds this pid: it is pid or one of its parents, in pid's mount
    namespace (a container's processes all are; a process elsewhere never is)."""
    return bool(root_pid) and int(root_pid) in ancestors(pid) and same_mount_ns(root_pid, pid)


def candidates_summary(matches):
    """For messages: the ids a cgroup proposed."""
    return ", ".join("%s %s" % (m.runtime or "kubernetes", m.id[:12]) for m in matches) or "none"


def pick(matches: list[CgroupMatch], verify):
    """The first proposal (outermost) that verify(match) confirms: (match, what verify returned), or (None, None)."""
    for m in matches:
        got = verify(m)
        if got:
            return m, got
    return None, None


# --- the runtimes' own records on the node (root's, except a rootless podman user's run directory) ---------------

CONTAINERD_TASKS = ("/run/containerd/io.containerd.runtime.v2.task",)
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
STORAGE_RUNROOTS = ("/run/containers/storage",)  # podman rootful and CRI-O (containers/storage's runroot)
USER_RUNTIME_DIRS = "/run/user"  # a rootless podman's runroot: /run/user/UID/containers
STATE_LIMIT = 1 << 20  # a config.json (an OCI spec) is a few KB; a larger one is not read


@dataclass(frozen=True)
class Record:
    """A runtime's record of one running container: its first process's host pid and where that was read."""

    runtime: str
    id: str
    root_pid: int
    ns: str | None = None  # containerd namespace
    rootless_uid: int | None = None
    annotations: dict[str, str] | None = None  # the OCI spec's, where the record has one
    where: str = ""


def _read_small(path, nofollow=True):
    return read_text(path, 4096, nofollow=nofollow, max_size=4096)


def _pid_file(path):
    try:
        pid = int(_read_small(path).strip() or "0")
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def _spec_annotations(path):
    try:
        spec = json.loads(read_text(path, STATE_LIMIT, nofollow=True, max_size=STATE_LIMIT))
    except (OSError, ValueError):
        return {}
    ann = spec.get("annotations") if isinstance(spec, dict) else None
    return {k: v for k, v in ann.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(ann, dict) \
        else {}


def _real_dir(path, owner=None):
    """A directory, not a link to one (and owned by `owner` where given)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (owner is None or st.st_uid == owner)


def _listdir(path):
    try:
        return sorted(x for x in os.listdir(path) if _NAME.match(x))
    except OSError:
        return []


def containerd_records(want_id=None, tasks=CONTAINERD_TASKS):
    """containerd's running tasks (every namespace: k8s.io for a kubelet, moby for docker, default for ctr)."""
    for top in tasks:
        if not _real_dir(top, 0):
            continue
        for ns in _listdir(top):
            if not _real_dir(os.path.join(top, ns), 0):  # every component root's own directory, no link
                continue
            for cid in ([want_id] if want_id else _listdir(os.path.join(top, ns))):
                d = os.path.join(top, ns, cid)
                if not _NAME.match(cid) or not _real_dir(d, 0):
                    continue
                pid = _pid_file(os.path.join(d, "init.pid"))
                if pid:
                    yield Record(CONTAINERD, cid, pid, ns=ns, where=d)


def _storage_records(runroot, rootless_uid, want_id=None):
    """containers/storage's per-container run data: <runroot>/<driver>-containers/<id>/userdata/pidfile (podman's;
    CRI-O's carries its OCI spec with io.kubernetes.cri-o.* annotations)."""
    for kind in _listdir(runroot):
        if not kind.endswith("-containers") or not _real_dir(os.path.join(runroot, kind), rootless_uid or 0):
            continue
        for cid in ([want_id] if want_id else _listdir(os.path.join(runroot, kind))):
            d = os.path.join(runroot, kind, cid, "userdata")
            if not re.match(r"^%s$" % _HEX64, cid) or not _real_dir(os.path.join(runroot, kind, cid)) \
                    or not _real_dir(d):
                continue
            pid = _pid_file(os.path.join(d, "pidfile"))
            if pid:  # podman's or CRI-O's: its spec's annotations tell (read only for the one kept: annotated())
                yield Record(PODMAN, cid, pid, rootless_uid=rootless_uid, where=d)


def storage_records(want_id=None, runroots=STORAGE_RUNROOTS, users=USER_RUNTIME_DIRS):
    """podman's (rootful, then each user's rootless) and CRI-O's running containers."""
    for rr in runroots:
        if _real_dir(rr, 0):
            for r in _storage_records(rr, None, want_id):
                yield r
    for u in _listdir(users):
        if not u.isdigit():
            continue
        uid = int(u)
        rr = os.path.join(users, u, "containers")
        if uid and _real_dir(os.path.join(users, u), uid) and _real_dir(rr, uid):
            for r in _storage_records(rr, uid, want_id):
                yield r


def annotated(rec):
    """The record with its OCI spec's annotations (config.json beside its pid file), and CRI-O told from podman
    by them (CRI-O writes io.kubernetes.cri-o.*)."""
    if rec.annotations is not None or rec.where.startswith(("docker ", "podman ")) or not rec.where:
        return rec
    ann = _spec_annotations(os.path.join(rec.where, "config.json"))
    runtime = CRIO if rec.runtime == PODMAN and any(k.startswith("io.kubernetes.cri-o.") for k in ann) \
        else rec.runtime
    return Record(runtime, rec.id, rec.root_pid, ns=rec.ns, rootless_uid=rec.rootless_uid, annotations=ann,
                  where=rec.where)


def _maps_user(pid, uid):
    """The process runs in a user namespace that uid's podman made: its uid_map maps to uid (or its subuids'
    start), so a rootless user's pidfile can only name processes of that user's own containers."""
    try:
        lines = _read_small("/proc/%d/uid_map" % int(pid), nofollow=False).splitlines()
        st = os.stat("/proc/%d" % int(pid))
    except (OSError, ValueError):
        return False
    outer = [int(x.split()[1]) for x in lines if len(x.split()) == 3]
    return uid in outer and st.st_uid != 0  # the node's root is never a rootless user's container process


def docker_record(cid):
    """docker's own answer (its CLI): the container's State.Pid, name, labels and image."""
    rc, out, _err = run_argv(["docker", "inspect", "--type", "container", cid], timeout=20)
    if rc != 0:
        return None
    try:
        d = json.loads(out)[0]
    except (ValueError, IndexError, TypeError):
        return None
    st = d.get("State") or {}
    if not st.get("Running") or not st.get("Pid"):
        return None
    cfg = d.get("Config") or {}
    labels = cfg.get("Labels") or {}
    return Record(DOCKER, d.get("Id") or cid, int(st["Pid"]), annotations=dict(labels), where="docker inspect"), {
        "name": (d.get("Name") or "").lstrip("/"), "image": cfg.get("Image")}


def _podman_inspect(cid, rootless_uid=None):
    argv = ["podman", "inspect", "--type", "container", cid]
    env = None
    if rootless_uid is not None:  # that user's podman: its runtime directory and home (its storage), from /
        import pwd

        try:
            pw = pwd.getpwuid(rootless_uid)
        except KeyError:
            return None
        argv = ["runuser", "-u", pw.pw_name, "--", "env", "-C", "/"] + argv
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": pw.pw_dir, "USER": pw.pw_name,
               "XDG_RUNTIME_DIR": "%s/%d" % (USER_RUNTIME_DIRS, rootless_uid)}
    rc, out, _err = run_argv(argv, timeout=20, env=env)
    if rc != 0:
        return None
    try:
        d = json.loads(out)[0]
    except (ValueError, IndexError, TypeError):
        return None
    return d


def _ctr_info(ns, cid):
    rc, out, _err = run_argv(["ctr", "--address", CONTAINERD_SOCKET, "-n", ns, "containers", "info", cid], timeout=20)
    if rc != 0:
        return {}
    try:
        d = json.loads(out)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _process_ids(pid):
    try:
        st = read_text("/proc/%d/status" % int(pid), 1 << 16)
    except (OSError, ValueError):
        return 0, 0
    ids = {}
    for line in st.splitlines():
        k, _sep, v = line.partition(":")
        if k in ("Uid", "Gid"):
            ids[k] = int(v.split()[0])
    return ids.get("Uid", 0), ids.get("Gid", 0)


def _ref(rec, pid, match=None, extra=None):
    """A ContainerRef from a runtime's record (names from the runtime, then its labels/annotations)."""
    rec = annotated(rec)
    extra = dict(extra or {})
    labels = dict(rec.annotations or {})
    name = extra.get("name")
    image = extra.get("image")
    if rec.runtime == CONTAINERD:
        info = _ctr_info(rec.ns, rec.id)
        labels.update({k: v for k, v in (info.get("Labels") or {}).items() if isinstance(v, str)})
        image = info.get("Image") or image
        name = rec.id
    elif rec.runtime == PODMAN and not name:
        d = _podman_inspect(rec.id, rec.rootless_uid) or {}
        name = d.get("Name")
        image = d.get("ImageName") or image
        labels.update({k: v for k, v in ((d.get("Config") or {}).get("Labels") or {}).items() if isinstance(v, str)})
    pod, namespace, container, pod_uid = kubernetes_names(labels)
    uid, gid = _process_ids(pid)
    kube = bool(pod or (match is not None and match.kubernetes) or rec.ns == "k8s.io"
                or any(k.startswith("io.kubernetes.") for k in labels))
    return ContainerRef(runtime=rec.runtime, id=rec.id, root_pid=rec.root_pid, uid=uid, gid=gid,
                        name=name or (container if rec.runtime == CRIO else None), pod=pod, namespace=namespace,
                        container=container, pod_uid=pod_uid or (match.pod_uid if match is not None else None),
                        kubernetes=kube, runtime_namespace=rec.ns, rootless_uid=rec.rootless_uid, image=image,
                        cgroup=match.path if match is not None else None,
                        labels={k: v for k, v in sorted(labels.items())[:64]})


def _verified(rec, pid):
    if rec is None or not owns(rec.root_pid, pid):
        return False
    return rec.rootless_uid is None or _maps_user(rec.root_pid, rec.rootless_uid)


def _records_for(m):
    """The runtime records a cgroup proposal can be checked against."""
    if m.runtime == DOCKER:
        got = docker_record(m.id)
        return [got] if got else []
    out = []
    if m.runtime in (None, CONTAINERD):
        out += [(r, None) for r in containerd_records(m.id) if m.ns is None or r.ns == m.ns]
    if m.runtime in (None, PODMAN, CRIO):
        out += [(r, None) for r in storage_records(m.id)]
    if m.runtime is None:
        got = docker_record(m.id)  # a kubelet with cri-dockerd
        out += [got] if got else []
    return out


def locate(pid):
    """The container a node's process runs in, or None (a plain process). The cgroup path proposes; a runtime's
    record whose first process is the pid or its parent, in the pid's mount namespace, decides. Where no cgroup
    names one (a rootless podman on cgroup v1 has no cgroup of its own), every runtime record is asked."""
    pid = int(pid)
    for m in cgroup_candidates(pid):
        for rec, extra in _records_for(m):
            if _verified(rec, pid):
                return _ref(rec, pid, m, extra)
    for rec in list(containerd_records()) + list(storage_records()):
        if _verified(rec, pid):
            return _ref(rec, pid)
    return None


def _kube_name_matches(ref_labels, name):
    pod, ns, container, _uid = kubernetes_names(ref_labels)
    if not container:
        return False
    return name in (container, "%s/%s" % (pod, container), "%s/%s/%s" % (ns, pod, container))


def resolve(name):
    """`--container NAME|ID` through each runtime on the node: docker's and podman's names and ids (their CLIs),
    containerd's ids in every namespace, a Kubernetes container as CONTAINER, POD/CONTAINER or NAMESPACE/POD/
    CONTAINER (from its labels or annotations; no Kubernetes API). One ContainerRef, or Refusal saying what
    was found."""
    if not name or len(name) > 253 or not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.+/-]*$", name) or ".." in name:
        raise Refusal("--container %r: not a container name or id" % (name,))
    found = []
    if "/" not in name:
        got = docker_record(name)
        if got:
            rec, extra = got
            found.append(_ref(rec, rec.root_pid, None, extra))
        d = _podman_inspect(name)
        if d and (d.get("State") or {}).get("Pid"):
            rec = Record(PODMAN, d.get("Id") or name, int(d["State"]["Pid"]), where="podman inspect")
            found.append(_ref(rec, rec.root_pid, None, {"name": d.get("Name"), "image": d.get("ImageName")}))
    short = re.match(r"^[0-9a-f]{4,64}$", name) is not None
    for rec in list(containerd_records()) + list(storage_records()):
        if any(f.id == rec.id for f in found):
            continue
        by_id = rec.id == name or (short and rec.id.startswith(name))
        if by_id or ("/" in name or not short) and _kube_name_matches(annotated(rec).annotations, name):
            found.append(_ref(rec, rec.root_pid))
        elif rec.runtime == CONTAINERD and _kube_name_matches(_ctr_info(rec.ns, rec.id).get("Labels") or {}, name):
            found.append(_ref(rec, rec.root_pid))
    if "/" not in name and not found:  # a rootless podman's: that user's podman knows its names
        for u in _listdir(USER_RUNTIME_DIRS):
            if u.isdigit() and int(u) and _real_dir(os.path.join(USER_RUNTIME_DIRS, u, "containers"), int(u)):
                d = _podman_inspect(name, int(u))
                pid = int((d or {}).get("State", {}).get("Pid") or 0)
                if pid and _maps_user(pid, int(u)):
                    rec = Record(PODMAN, d.get("Id") or name, pid, rootless_uid=int(u), where="podman inspect")
                    found.append(_ref(rec, pid, None, {"name": d.get("Name"), "image": d.get("ImageName")}))
    if not found:
        raise Refusal("no running container %s on this node (asked docker, podman, containerd and CRI-O's records)"
                      % name)
    if len(found) > 1:
        raise Refusal("--container %s names several containers: %s; give a full id" % (
            name, "; ".join("%s %s" % (f.label(), f.id) for f in found)))
    return found[0]
