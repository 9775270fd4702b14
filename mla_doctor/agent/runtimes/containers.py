"""Which container a node's process runs in, seen from the node as root: the runtime and container id named by
its cgroup path (docker, podman rootful and rootless, containerd with or without Kubernetes, CRI-O), checked
against the runtime's own record of the container's first process, and the names a person knows it by (the
container's name; a Kubernetes pod's name, namespace and container name from the runtime's labels or
annotations). Nothing here trusts a name the container could write: a cgroup path only proposes an id, the
runtime's state on the node decides.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..common import read_text

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

    runtime: Optional[str]  # None: a Kubernetes cgroupfs path, which does not say the runtime
    id: str
    kubernetes: bool = False
    pod_uid: Optional[str] = None
    rootless_uid: Optional[int] = None  # podman run by this user (its user@UID.service)
    ns: Optional[str] = None  # containerd namespace, where the path names one (ctr's cgroupfs /<ns>/<id>)
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
    name: Optional[str] = None  # the runtime's name for it (docker/podman name; containerd: its id)
    pod: Optional[str] = None  # Kubernetes pod name
    namespace: Optional[str] = None  # Kubernetes namespace
    container: Optional[str] = None  # Kubernetes container name
    pod_uid: Optional[str] = None
    kubernetes: bool = False  # managed by a kubelet: its pod's controller would replace a restarted container
    runtime_namespace: Optional[str] = None  # containerd namespace (k8s.io, moby, default)
    rootless_uid: Optional[int] = None  # podman rootless: the user whose podman runs it
    image: Optional[str] = None
    cgroup: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)

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
    where = "pod %s%s" % (ref.namespace + "/" if ref.namespace else "", ref.pod) if ref.pod else \
        "a Kubernetes pod%s" % (" (uid %s)" % ref.pod_uid if ref.pod_uid else "")
    return ("the server runs in %s (%s): a restart would be undone by the pod's controller, which replaces a "
            "container that stops; use --method attach (no restart)" % (where, ref.label()))


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


def pick(matches: List[CgroupMatch], verify):
    """The first proposal (outermost) that verify(match) confirms: (match, what verify returned), or (None, None)."""
    for m in matches:
        got = verify(m)
        if got:
            return m, got
    return None, None
