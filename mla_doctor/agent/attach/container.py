"""Attach from the node to a server in a container (another mount namespace than the agent's).

gdb runs on the node against the host pid, as for any process. What the probe needs to reach -- its file, the
lease and the records directory, all in the node's run directory -- is made reachable inside the container by a
bind mount of that run directory, cloned on the node (open_tree) and moved into the container's mount namespace
(setns, then move_mount) on a directory the node's root creates there, in a forked child. Nothing the container
controls is trusted: the mount's source is the node's own directory (never a path the container names), the
directory it covers is created with O_EXCL semantics in a place checked first (a directory, not a link, on a
writable mount), and every step inside the container runs in a child chrooted there by the kernel (setns), so no
link in the container's filesystem leads out of it. The node's watchdog and lease are unchanged; closing the run
unmounts and removes the directory (closing.py), found again by the namespace's inode, never by a pid alone.

Refused before anything changes (with why): no writable place in the container (a read-only root filesystem
without a writable tmpfs at /dev/shm, /tmp or /var/tmp), and a kernel without the new mount API.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat

# where the covered directory may go, in this order: /dev/shm is a tmpfs in every docker/podman/containerd
# container (writable even under --read-only), then the usual temporary directories
PLACES = ("/dev/shm", "/tmp", "/var/tmp")
ST_RDONLY = getattr(os, "ST_RDONLY", 1)
CLONE_NEWNS = 0x00020000
AT_FDCWD = -100
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
# x86_64 and aarch64 (and every architecture since 5.2): the unified syscall numbers
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
DIR_PREFIX = "mla-doctor-"
CHILD_TIMEOUT = 20.0


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def mnt_ns(pid):
    """The inode of the process's mount namespace, or None."""
    try:
        return os.stat("/proc/%s/ns/mnt" % pid).st_ino
    except OSError:
        return None


def in_container(pid):
    """The process sees another filesystem than the agent: another mount namespace (a container)."""
    theirs, ours = mnt_ns(pid), mnt_ns("self")
    return theirs is not None and ours is not None and theirs != ours


def _id_map(pid, kind):
    rows = []
    try:
        with open("/proc/%s/%s_map" % (pid, kind)) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and all(p.isdigit() for p in parts):
                    rows.append(tuple(int(p) for p in parts))
    except OSError:
        pass
    return rows


def overflow_uid():
    try:
        with open("/proc/sys/fs/overflowuid") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 65534


def inside_uid(pid, node_uid):
    """`node_uid` as the container's processes see it (its user namespace's uid_map), or the overflow uid
    (nobody) when it is not mapped there: what fstat answers inside for a file the node's root owns."""
    for inner, outer, count in _id_map(pid, "uid"):
        if outer <= node_uid < outer + count:
            return inner + (node_uid - outer)
    return overflow_uid()


def in_ns(pid, fn, args=(), timeout=CHILD_TIMEOUT, before=None, ids=None, cap=4 << 20):
    """fn(*args) in a forked child that entered the mount namespace of `pid` (its root and cwd are the
    container's root then: every absolute path and link resolves inside the container). `before()` runs in the
    child first, still on the node (open_tree of a node path); its result is then fn's first argument. The
    answer as privilege.call_as gives it: JSON-able, at most `cap` bytes; an exception comes back as OSError.
    With `ids` (uid, gid, groups) the child drops to them once inside: it reads what that user may read there."""
    from ..privilege import call_as, drop_to

    def child():
        pre = before() if before is not None else None
        nsfd = os.open("/proc/%d/ns/mnt" % int(pid), os.O_RDONLY | os.O_CLOEXEC)
        if _libc().setns(nsfd, CLONE_NEWNS) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "setns into the container's mount namespace: " + os.strerror(e))
        os.close(nsfd)
        os.chdir("/")
        if ids is not None:
            drop_to(*ids)
        return fn(pre, *args) if before is not None else fn(*args)

    return call_as((0, 0, []), child, (), timeout=timeout, cap=cap)


def _place_facts(places):
    """In the container: each candidate place as (path, why not or None)."""
    out = []
    for p in places:
        try:
            st = os.lstat(p)
        except OSError as e:
            out.append([p, "absent (%s)" % (e.strerror or e)])
            continue
        if not stat.S_ISDIR(st.st_mode):
            out.append([p, "not a directory (a link or a file)"])
            continue
        try:
            ro = bool(os.statvfs(p).f_flag & ST_RDONLY)
        except OSError as e:
            out.append([p, "statvfs failed (%s)" % (e.strerror or e)])
            continue
        out.append([p, "on a read-only mount" if ro else None])
    root_ro = bool(os.statvfs("/").f_flag & ST_RDONLY)
    return {"places": out, "root_read_only": root_ro}


def inspect(pid):
    """What attaching into this container needs, read before anything changes: the place for the run's
    directory, how the node's root is seen inside, the refusals (each says why)."""
    out = {"pid": int(pid), "mnt_ns": mnt_ns(pid), "root_uid_inside": inside_uid(pid, 0), "refused": []}
    try:
        facts = in_ns(pid, _place_facts, (list(PLACES),))
    except OSError as e:
        out["refused"].append("cannot enter the container's mount namespace from the node (%s)"
                              % (e.strerror or e))
        return out
    out.update(facts)
    ok = [p for p, why in facts["places"] if why is None]
    if ok:
        out["place"] = ok[0]
    else:
        out["refused"].append(
            "the container has no writable place for the probe's directory (%s%s): give it a writable tmpfs "
            "(docker run --tmpfs /tmp, or keep its /dev/shm)"
            % ("its root filesystem is read-only; " if facts.get("root_read_only") else "",
               "; ".join("%s %s" % (p, why) for p, why in facts["places"])))
    if not _has_mount_api():
        out["refused"].append("this kernel lacks open_tree/move_mount (Linux 5.2 or newer needed) to make the "
                              "probe's directory reachable inside the container")
    return out


def _has_mount_api():
    """open_tree exists (ENOSYS when not): probed on a harmless invalid call."""
    libc = _libc()
    r = libc.syscall(SYS_OPEN_TREE, -1, b"", 0)
    return not (r == -1 and ctypes.get_errno() == errno.ENOSYS)


def _open_tree(path):
    def pre():
        fd = _libc().syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), OPEN_TREE_CLONE | os.O_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, "open_tree %s: %s" % (path, os.strerror(e)))
        return fd
    return pre


def _mount_in(tree_fd, place, name):
    """In the container: create place/name (root's, 0755, never an existing one) and move the node's cloned
    tree onto it."""
    pfd = os.open(place, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.mkdir(name, 0o755, dir_fd=pfd)  # EEXIST on anything already there, a planted link included
        target = os.path.join(place, name)
        st = os.lstat(target)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EEXIST, "%s is not the directory just made" % target)
        r = _libc().syscall(SYS_MOVE_MOUNT, tree_fd, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH)
        if r != 0:
            e = ctypes.get_errno()
            try:
                os.rmdir(name, dir_fd=pfd)
            except OSError:
                pass
            raise OSError(e, "move_mount onto %s: %s" % (target, os.strerror(e)))
    finally:
        os.close(pfd)
    return target


def mount_run_dir(pid, run_dir, place, run_id):
    """The node's run directory, bound onto <place>/mla-doctor-<run id> inside the container: its path there."""
    name = DIR_PREFIX + run_id
    if "/" in name or name in (".", ".."):
        raise ValueError("run id %r" % run_id)
    return in_ns(pid, _mount_in, (place, name), before=_open_tree(run_dir))


def _unmount_in(target):
    """In the container: detach the mount on `target` (never following a link put there) and remove the
    directory, if it is still the empty one made for it."""
    done = []
    r = _libc().umount2(os.fsencode(target), MNT_DETACH | UMOUNT_NOFOLLOW)
    if r == 0:
        done.append("unmounted")
    else:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            raise OSError(e, "umount %s: %s" % (target, os.strerror(e)))
    try:
        st = os.lstat(target)
    except OSError:
        return done
    if stat.S_ISDIR(st.st_mode):
        try:
            os.rmdir(target)
            done.append("removed")
        except OSError as e:
            raise OSError(e.errno, "rmdir %s: %s" % (target, e.strerror)) from None
    return done


def ns_holder(ns_inode, hint_pid=None):
    """A live process in the mount namespace `ns_inode` (the hint first), or None: the namespace is gone."""
    pids = ([str(hint_pid)] if hint_pid else []) + [p for p in os.listdir("/proc") if p.isdigit()]
    for p in pids:
        if mnt_ns(p) == ns_inode:
            return int(p)
    return None


def unmount_run_dir(info):
    """Undo mount_run_dir (info: the manifest's `container`): a description of what was done."""
    if not isinstance(info, dict) or not info.get("dir"):
        return "nothing mounted"
    holder = ns_holder(info.get("mnt_ns"), info.get("pid"))
    if holder is None:
        return "the container's mount namespace is gone (nothing left in it)"
    done = in_ns(holder, _unmount_in, (info["dir"],))
    return ", ".join(done) or "nothing left"


def left_in(info):
    """In the container: whether anything of the run is left (the directory): for the proof after a run."""
    holder = ns_holder(info.get("mnt_ns"), info.get("pid")) if isinstance(info, dict) else None
    if holder is None:
        return False
    return bool(in_ns(holder, _exists_in, (info["dir"],)))


def _exists_in(target):
    try:
        os.lstat(target)
        return True
    except OSError:
        return False
