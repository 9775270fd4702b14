"""gdb, run as root against a process whose files another user owns, so it loads nothing of theirs:
no init files (-nx -nh), no auto-loaded scripts (auto-load off: no *-gdb.py beside their libpython or
interpreter, no .debug_gdb_scripts, no local .gdbinit), no libthread_db from their library path, no
debuginfod, no shared-library symbols but libpython's, a clean environment, cwd /.

The code it makes the interpreter run is a bootstrap of a few lines that reads the run's probe file
(root's, in the root-owned run directory, opened with O_NOFOLLOW, checked by fstat) and runs it only if
its sha256 is the one in the bootstrap itself: nobody else can change what runs.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time

GDB_PATHS = ("/usr/bin/gdb", "/usr/local/bin/gdb", "/bin/gdb")
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C", "LC_ALL": "C", "HOME": "/nonexistent",
             "TERM": "dumb"}
# before gdb reads the process's files: none of them may configure or extend gdb
SAFE_SETTINGS = ("set auto-load off", "set debuginfod enabled off", "set libthread-db-search-path /nonexistent",
                 "set auto-solib-add off", "set history save off", "set index-cache enabled off",
                 "set pagination off", "set confirm off", "set width 0")
GDB_TIMEOUT = 60.0


def trusted_gdbs():
    """Each root-owned gdb nobody else can replace (file and directory), in GDB_PATHS' order."""
    found = []
    for p in GDB_PATHS:
        try:
            real = os.path.realpath(p)
            st, dst = os.stat(real), os.stat(os.path.dirname(real))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022 and dst.st_uid == 0 \
                and not dst.st_mode & 0o022 and os.access(real, os.X_OK) and real not in found:
            found.append(real)
    return found


_CHOSEN = {}


def choose_gdb():
    """(the first trusted gdb whose injected call leaves a process alive, [why each other one was not taken]).
    Each is tried on a throwaway process of ours first: a gdb that cannot write this CPU's register state back
    (gdb 13 on a CPU with AMX: "Couldn't write extended state status") kills the process it calls into, and it
    must never get that far with a server. Decided once per agent process."""
    if "gdb" not in _CHOSEN:
        why = []
        chosen = None
        for gdb in trusted_gdbs():
            ok, detail = self_test(gdb)
            # ptrace itself refused (seccomp, Yama, no CAP_SYS_PTRACE): gdb is not to blame, and attach's ptrace
            # check (checks.ptrace_refusals) says why before anything changes
            if ok or detail.startswith(PTRACE_REFUSED):
                chosen = gdb
                break
            why.append("%s: %s" % (gdb, detail))
        _CHOSEN["gdb"] = (chosen, why)
    return _CHOSEN["gdb"]


def find_gdb():
    """The gdb attach uses (see choose_gdb), or None."""
    return choose_gdb()[0]


SLEEP_PATHS = ("/usr/bin/sleep", "/bin/sleep")
PTRACE_REFUSED = "ptrace refused even on a throwaway process: "


def _libc_of(pid):
    try:
        with open("/proc/%d/maps" % pid) as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                base = os.path.basename(path)
                if path.startswith("/") and (base.startswith("libc.so") or base.startswith("libc-")
                                             or base.startswith("ld-musl")):
                    return path
    except OSError:
        pass
    return None


def self_test(gdb, timeout=30.0):
    """(ok, detail): gdb calls getpid() in a throwaway sleep of ours, the way inject calls into a server, and
    the sleep must answer its own pid and still be running after gdb detached."""
    sleep = next((p for p in SLEEP_PATHS if os.path.isfile(p)), None)
    if sleep is None:
        return False, "no %s to try gdb on" % " or ".join(SLEEP_PATHS)
    # in a session of its own, as gdb is: a signal to the agent's group must not stop it under gdb's call
    child = subprocess.Popen([sleep, "120"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=dict(CLEAN_ENV), cwd="/", close_fds=True,
                             start_new_session=True)
    try:
        libc = None
        for _ in range(100):  # the dynamic loader maps libc within milliseconds of exec
            libc = _libc_of(child.pid)
            if libc:
                break
            time.sleep(0.01)
        if libc is None:
            return False, "could not find the C library of a throwaway %s (pid %d)" % (sleep, child.pid)
        rc, out, err = run_gdb(gdb_argv(gdb, child.pid, ["call (int)getpid()"], libc), timeout)
        if "ptrace: Operation not permitted" in out + err or "Could not attach" in out + err:
            return False, PTRACE_REFUSED + _first(out + "\n" + err, ("ptrace:", "Could not attach"))
        answered = any(line.strip() == "$1 = %d" % child.pid for line in out.splitlines())
        alive = child.poll() is None
        if answered and alive:
            return True, "an injected call returned and the process lived on"
        said = _first(out + "\n" + err, ("Couldn't", "Cannot", "ptrace:", "warning: Couldn't", "Error"))
        return False, ("an injected call into a throwaway process %s (gdb exit %s: %s); attaching with it would "
                       "do the same to the server" % ("killed it" if not alive else "did not return", rc, said))
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def gdb_argv(gdb, pid, commands, libpython=None, exe=None, sysroot=None):
    argv = [gdb, "-nx", "-nh", "-batch", "-q"]
    for s in SAFE_SETTINGS:
        argv += ["-iex", s]
    if sysroot:  # shared libraries only from our copies (see sysroot_with)
        argv += ["-iex", "set sysroot %s" % sysroot]
    if exe:  # gdb loads our copy and never opens the name /proc/PID/exe reads (see exe_copy)
        argv += ["-iex", "set exec-file-mismatch off", exe]
    argv += ["-p", str(int(pid))]
    if libpython:  # a shared-libpython interpreter: only that library's symbols
        argv += ["-ex", "sharedlibrary ^%s$" % _regex_escape(libpython)]
    for c in commands:
        argv += ["-ex", c]
    return argv


def _regex_escape(path):
    out = []
    for ch in path:
        out.append("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch)
    return "".join(out)


def c_string(text):
    """`text` as a C string literal for gdb's expression parser."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def run_gdb(argv, timeout=GDB_TIMEOUT):
    """(rc, stdout, stderr) of gdb in a clean environment from /, in its own session (a signal to the
    agent's group does not reach it halfway through a call in the inferior)."""
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(CLEAN_ENV), cwd="/", close_fds=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGINT first: gdb abandons a hung call and detaches; only then the hard way
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        return 124, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    return p.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def bootstrap(probe_path, sha256, size, owner_uid=0):
    """The code the interpreter runs: read the probe file, run it only if it is the agent's (root's) and
    nobody else may write it, and its hash is the one written here."""
    for ch in probe_path:
        if ch in "'\"\\\n" or ord(ch) < 32:
            raise ValueError("probe path %r has characters the bootstrap does not quote" % probe_path)
    return ("def _mla_doctor_boot():\n"
            " import hashlib,os,stat\n"
            " f=os.open('%s',os.O_RDONLY|os.O_NOFOLLOW|os.O_NONBLOCK|os.O_CLOEXEC)\n"
            " try:\n"
            "  s=os.fstat(f)\n"
            "  if not stat.S_ISREG(s.st_mode) or s.st_uid!=%d or s.st_mode&0o022:\n"
            "   return\n"
            "  d=os.read(f,%d)\n"
            " finally:\n"
            "  os.close(f)\n"
            " if hashlib.sha256(d).hexdigest()=='%s':\n"
            "  exec(compile(d,'%s','exec'),{'__name__':'mla_doctor_attach'})\n"
            "try:\n"
            " _mla_doctor_boot()\n"
            "except BaseException:\n"
            " pass\n"
            "del _mla_doctor_boot\n") % (probe_path, int(owner_uid), int(size) + 1, sha256, probe_path)


def pending_call_command(code):
    return "call (int)Py_AddPendingCall((int(*)(void*))PyRun_SimpleString, (void*)%s)" % c_string(code)


EXE_LIMIT = 512 << 20


def _copy_mapped(src, dest):
    """`src` (a /proc link to a file the process runs or maps) copied to `dest`, a new file of ours: opened without
    blocking, a regular file, at most EXE_LIMIT. Raises OSError."""
    fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > EXE_LIMIT:
            raise OSError(errno.EFBIG, "larger than %d MiB" % (EXE_LIMIT >> 20))
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            left = EXE_LIMIT
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
                while chunk:
                    chunk = chunk[os.write(out, chunk):]
        finally:
            os.close(out)
        return dest
    finally:
        os.close(fd)


def exe_copy(pid, into):
    """A copy, in our own directory `into`, of the executable the process runs, read through /proc/PID/exe (the
    mapped file itself). Left alone, gdb opens the executable by the name that link reads, which the server's
    user controls: once the file is replaced or deleted ('…/python3 (deleted)'), a FIFO planted at that name
    blocks gdb until its timeout, and given /proc/PID/exe instead, gdb's file cache reopens it by its resolved
    name, the same one. Raises OSError."""
    return _copy_mapped("/proc/%d/exe" % int(pid), os.path.join(into, "exe"))


def _mapping_of(pid, path):
    """The /proc/PID/map_files entry of the process's first mapping of `path`, or None."""
    try:
        with open("/proc/%d/maps" % int(pid)) as f:
            for line in f:
                parts = line.rstrip("\n").split(None, 5)
                if len(parts) == 6 and parts[5] == path:
                    return "/proc/%d/map_files/%s" % (int(pid), parts[0])
    except OSError:
        pass
    return None


def sysroot_with(pid, libpython, into):
    """gdb's sysroot: a directory of ours holding only a copy of the process's mapping of `libpython` at its
    path. gdb then looks every shared library up under it (so it opens no library by a name the server's user
    controls: a FIFO swapped in after the check would block it) and finds libpython there. (sysroot, the name
    gdb gives the library)."""
    root = os.path.join(into, "sysroot")
    os.mkdir(root, 0o700)
    if not libpython:
        return root, None
    rel = libpython.lstrip("/")
    if not libpython.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
        raise OSError(errno.EINVAL, "not a plain absolute path: %r" % libpython)
    src = _mapping_of(pid, libpython)
    if src is None:
        raise OSError(errno.ENOENT, "no mapping of %s" % libpython)
    os.makedirs(os.path.dirname(os.path.join(root, rel)), 0o700)
    _copy_mapped(src, os.path.join(root, rel))
    return root, os.path.join(root, rel)


def inject(gdb, pid, code, libpython=None, timeout=GDB_TIMEOUT):
    """Queue `code` to run in the process's main thread at its next eval-loop check. (ok, detail)."""
    scratch = tempfile.mkdtemp(prefix="mla-doctor-gdb-")  # root's, 0700: nobody else renames or swaps in it
    try:
        try:
            exe = exe_copy(pid, scratch)
        except OSError as e:
            return False, "the process's executable could not be read through /proc/%d/exe: %s" % (
                int(pid), e.strerror or e)
        try:
            sysroot, lib = sysroot_with(pid, libpython, scratch)
        except OSError as e:
            return False, "the process's %s could not be read through its mapping: %s" % (
                libpython, e.strerror or e)
        rc, out, err = run_gdb(gdb_argv(gdb, pid, [pending_call_command(code)], lib, exe, sysroot), timeout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return interpret(rc, out, err)


def interpret(rc, out, err):
    """gdb's output as (ok, what happened): "$1 = 0" is Py_AddPendingCall's success."""
    text = out + "\n" + err
    if "ptrace: Operation not permitted" in text or "Could not attach" in text:
        return False, "ptrace refused: " + _first(text, ("ptrace:", "Could not attach"))
    for line in out.splitlines():
        if line.strip().startswith("$1 = "):
            val = line.split("=", 1)[1].strip()
            if val == "0":
                return True, "queued"
            return False, "Py_AddPendingCall returned %s (the interpreter's pending-call queue is full)" % val
    if "No symbol" in text:
        return False, "the interpreter lacks the C-API symbols: " + _first(text, ("No symbol",))
    if rc == 124:
        return False, "gdb timed out (%s)" % _first(text, ("",))
    return False, "gdb failed (exit %s): %s" % (rc, text.strip()[-300:])


def _first(text, prefixes):
    for line in text.splitlines():
        if any(line.strip().startswith(p) for p in prefixes) and line.strip():
            return line.strip()
    return text.strip()[-200:]
