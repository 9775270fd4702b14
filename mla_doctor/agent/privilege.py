"""Root only for what needs root: the rule the agent keeps, and the two tools it keeps it with.

THE RULE. The agent runs as root because some of its work needs root: reading another user's /proc/PID
(environment, maps, fds), restarting a supervised server, ptrace for an injected probe. Nothing else is
done as root:

- everything that touches the service user's files or runs the service user's code (its interpreter, asked
  where vLLM is; its venv; its vLLM tree) happens AS THAT USER, in a child that dropped to its uid, gid and
  groups (setresgid, setgroups, setresuid) before it does anything: the kernel, not our checks, enforces
  that nothing outside that user's reach changes (run_as below);
- a file is changed or an interpreter is run as root only when the path to it is root's: every directory
  from / down, and the file, owned by root and not writable by group or others (a sticky directory such as
  /tmp excepted: nobody can replace root's entries there). The chain is walked by descriptors (openat with
  O_NOFOLLOW|O_DIRECTORY per component, a symlink's own owner checked before it is followed), never by
  re-resolving a path string, and owner and mode come from fstat of the opened descriptor (path_owner);
- the root agent itself runs on an interpreter that passes that check, always `-I -S -B` (no site, no
  environment variables, no cwd on sys.path), in a clean environment with cwd `/` (remote/runner.py chooses
  it, _boot.py cleans the environment); never on `--python` or a server's interpreter that another user can
  change (that one is asked, as its owner, where vLLM is: facts/install.py).

Nothing runs as root from a path another user can change.
"""
from __future__ import annotations

import errno
import os
import stat

# The PATH root's children search (the agent's environment is replaced by this when it runs as root).
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NOBODY = 65534  # who runs what root should not and no user owns (a root-owned but world-writable path)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_MAX_LINKS = 40


class Owner:
    """Who controls a path: `trusted` (root's all the way down), else `uid` (the first user other than root
    who can change it; NOBODY when only a loose mode of root's makes it changeable) and `why`."""

    def __init__(self, trusted, uid, why=None):
        self.trusted, self.uid, self.why = trusted, uid, why

    def __repr__(self):
        return "Owner(trusted=%r, uid=%r, why=%r)" % (self.trusted, self.uid, self.why)


def _loose(st):
    """Writable by group or others, and not a sticky directory (whose entries only their owners replace)."""
    if stat.S_ISLNK(st.st_mode):
        return False  # a symlink's own mode means nothing; its owner and directory do
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return False
    return bool(st.st_mode & 0o022)


def _verdict(path, st):
    """None when root's and tight, else an Owner naming who can change `path`."""
    if st.st_uid != 0:
        return Owner(False, st.st_uid, "%s is owned by uid %d" % (path, st.st_uid))
    if _loose(st):
        return Owner(False, NOBODY, "%s (root's) is writable by group or others (mode %04o)"
                     % (path, stat.S_IMODE(st.st_mode)))
    return None


def path_owner(path):
    """Owner of `path` (absolute): walks from / by descriptors, one component at a time with O_NOFOLLOW; a
    symlink met on the way is judged by its own owner and directory, then followed by restarting the walk
    at its target (so /bin -> usr/bin works, and each directory is still checked on a descriptor)."""
    if not os.path.isabs(path):
        return Owner(False, NOBODY, "%s is not an absolute path" % path)
    todo = [c for c in path.split("/") if c not in ("", ".")]
    hops = 0
    fd = os.open("/", _O_DIR)
    try:
        v = _verdict("/", os.fstat(fd))
        if v:
            return v
        cur = "/"
        while todo:
            c = todo.pop(0)
            if c == "..":
                cur = os.path.dirname(cur.rstrip("/")) or "/"
                nfd = os.open("..", _O_DIR, dir_fd=fd)
                os.close(fd)
                fd = nfd
                continue
            here = os.path.join(cur, c)
            try:
                st = os.stat(c, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return Owner(False, NOBODY, "%s does not exist" % here)
            v = _verdict(here, st)
            if v:
                return v
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_LINKS:
                    return Owner(False, NOBODY, "%s: too many symlinks" % here)
                target = os.readlink(c, dir_fd=fd)
                todo = [x for x in target.split("/") if x not in ("", ".")] + todo
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _O_DIR)
                    cur = "/"
                continue
            if todo:
                try:
                    nfd = os.open(c, _O_DIR, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ENOTDIR, errno.ELOOP):
                        return Owner(False, NOBODY, "%s is not a directory" % here)
                    raise
                os.close(fd)
                fd = nfd
                v = _verdict(here, os.fstat(fd))  # the directory opened, as it is now
                if v:
                    return v
            cur = here
        return Owner(True, 0)
    finally:
        os.close(fd)


def clean_for_root():
    """As root: cwd / and a clean environment -- PATH keeps only directories root controls (path_owner), a
    UTF-8 locale, root's own HOME; nothing else (no LD_PRELOAD, PYTHON*, HOME of whoever started us), so no
    child the agent starts (systemctl, nvidia-smi, docker) is found on or steered by a path another user can change."""
    if os.geteuid() != 0:
        return
    os.chdir("/")
    keep = []
    for d in (os.environ.get("PATH") or SAFE_PATH).split(":"):
        if d and d not in keep and os.path.isabs(d):
            try:
                if path_owner(d).trusted:
                    keep.append(d)
            except OSError:
                pass
    import pwd

    try:
        home = pwd.getpwuid(0).pw_dir  # root's own (kubectl, docker in a --runtime command find their config)
    except KeyError:
        home = "/"
    os.environ.clear()
    os.environ.update(PATH=":".join(keep) or SAFE_PATH, LANG="C.UTF-8", HOME=home)


def proc_ids(pid):
    """(uid, gid, supplementary groups) a process runs as, from /proc/PID/status (its effective ids)."""
    uid = gid = None
    groups = []
    with open("/proc/%d/status" % int(pid)) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k == "Uid":
                uid = int(v.split()[1])
            elif k == "Gid":
                gid = int(v.split()[1])
            elif k == "Groups":
                groups = [int(x) for x in v.split()]
    if uid is None or gid is None:
        raise OSError(errno.ESRCH, "no ids for pid %s" % pid)
    return uid, gid, groups


def ids_of_uid(uid):
    """(uid, gid, groups) of a user by uid: its primary group and its groups from the group database."""
    import pwd

    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return uid, uid if uid != NOBODY else NOBODY, []
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    return uid, pw.pw_gid, groups


def drop_to(uid, gid, groups):
    """In a child, before anything else: become (uid, gid, groups) for good (real, effective and saved ids),
    or raise. Group ids first: once the uid is dropped they can no longer be changed."""
    if os.geteuid() != 0:
        if os.geteuid() != uid:
            raise PermissionError(errno.EPERM, "cannot become uid %d" % uid)
        return
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise PermissionError(errno.EPERM, "privileges not dropped")


def run_as(ids, argv, env, cwd="/", timeout=20.0, cap=1 << 20):
    """Run argv as `ids` (uid, gid, groups), or as ourselves when ids is None: (rc, stdout, stderr, why).
    Output is read to at most `cap` bytes each and within `timeout` seconds (a FIFO named *.pth, a child
    printing forever): then the child is killed and `why` says so. rc None when it could not start."""
    import select
    import signal
    import subprocess  # only here: common.py's note (not imported at start)

    def preexec():
        if ids is not None:
            drop_to(*ids)

    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, cwd=cwd, preexec_fn=preexec, close_fds=True, start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:
        return None, b"", b"", "cannot run %s: %s" % (argv[0], e)
    import time

    deadline = time.monotonic() + timeout
    ofd, efd = p.stdout.fileno(), p.stderr.fileno()
    bufs = {ofd: [], efd: []}
    sizes = dict.fromkeys(bufs, 0)
    open_fds = set(bufs)
    why = None
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timed out after %ss" % timeout
                break
            ready, _, _ = select.select(list(open_fds), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.discard(fd)
                    continue
                if sizes[fd] + len(chunk) > cap:
                    why = "printed more than %d bytes" % cap
                    open_fds.clear()
                    break
                bufs[fd].append(chunk)
                sizes[fd] += len(chunk)
    finally:
        if why:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        p.stdout.close()
        p.stderr.close()
        try:
            rc = p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
    return rc, b"".join(bufs[ofd]), b"".join(bufs[efd]), why


def call_as(ids, fn, args=(), timeout=20.0, cap=4 << 20):
    """fn(*args)'s JSON-able result, computed in a forked child that dropped to `ids` (uid, gid, groups) before
    anything else -- so what it opens, the kernel checks as that user, symlinks and all; with ids None (or when
    we are not root), here. The one fork-and-drop of the agent (install_fs.as_controller is this too). An
    exception in the child (the drop included) comes back as OSError with its errno, text and file name; a
    child that died, ran past `timeout` or answered more than `cap` bytes is killed: OSError too."""
    if ids is None or os.geteuid() != 0:
        return fn(*args)
    import json
    import select
    import signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop, act, answer, exit -- never return into the agent, none of its teardown
        try:
            os.close(r)
            try:
                drop_to(*ids)
                doc = {"ok": fn(*args)}
            except BaseException as e:  # noqa: BLE001 -- its errno and text are the answer
                doc = {"errno": getattr(e, "errno", None) or errno.EPERM,
                       "error": "as uid %d: %s" % (ids[0], getattr(e, "strerror", None) or e),
                       "filename": getattr(e, "filename", None)}
            data = json.dumps(doc).encode("utf-8")
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks, size, why = [], 0, None
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                why = "timed out after %ss" % timeout
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > cap:
                why = "answered more than %d bytes" % cap
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        if why:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.waitpid(pid, 0)
    if why:
        raise OSError(errno.ETIMEDOUT, "as uid %d: %s" % (ids[0], why))
    try:
        doc = json.loads(b"".join(chunks).decode("utf-8") or "{}")
    except ValueError:
        doc = {}
    if "ok" in doc:
        return doc["ok"]
    raise OSError(doc.get("errno") or errno.EPERM, doc.get("error") or "as uid %d: the child died" % ids[0],
                  doc.get("filename"))


# What `python -s` runs at start beyond the interpreter: site-packages' .pth lines and sitecustomize, from the
# prefix's site directories. An interpreter root trusts but whose site directory (or a .pth in it) another user
# can change would run that user's code as root: it is asked as that user instead (site_owner).
_SITE_GLOBS = ("lib*/python*/site-packages", "lib*/python*/dist-packages", "local/lib*/python*/site-packages",
               "local/lib*/python*/dist-packages", "lib*/python3/dist-packages")
_STARTUP = (".pth", "sitecustomize.py", "usercustomize.py")


def site_owner(python):
    """Owner of what `python -s` runs at start: its prefix's site directories (for the interpreter as named --
    a venv's bin/python -- and as resolved), every directory above them, and the .pth / sitecustomize files in
    them (each judged by its own lstat: a symlink is another user's if they own it). An Owner, trusted only
    when all of it is root's and tight; a site directory that does not exist changes nothing."""
    import glob

    prefixes = []
    for p in (python, os.path.realpath(python)):
        pre = os.path.dirname(os.path.dirname(os.path.abspath(p)))
        if pre not in prefixes:
            prefixes.append(pre)
    if "/usr" in prefixes and "/usr/local" not in prefixes:
        prefixes.append("/usr/local")  # Debian's site adds /usr/local/lib/pythonX.Y/dist-packages
    for pre in prefixes:
        for pattern in _SITE_GLOBS:
            for d in sorted(glob.glob(os.path.join(glob.escape(pre), pattern))):
                owner = path_owner(d)
                if not owner.trusted:
                    return owner
                try:
                    names = os.listdir(d)
                except OSError as e:
                    return Owner(False, NOBODY, "%s: %s" % (d, e.strerror))
                for n in names:
                    if n.endswith(_STARTUP):
                        try:
                            v = _verdict(os.path.join(d, n), os.lstat(os.path.join(d, n)))
                        except OSError:
                            continue
                        if v:
                            return v
    return Owner(True, 0)
