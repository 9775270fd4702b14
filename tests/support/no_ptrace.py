"""Run a command under a seccomp filter that refuses ptrace(2) with EPERM (x86_64), as a container's
default profile or a hardened unit would: `python no_ptrace.py CMD ARGS...`. Nothing on the machine
changes (the filter belongs to this process and its children); never kernel.yama.ptrace_scope."""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
NR_PTRACE = {"x86_64": 101, "aarch64": 117}
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> None:
    nr = NR_PTRACE[platform.machine()]
    insns = [(BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
             (BPF_JEQ_K, 0, 1, nr),
             (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),
             (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *i) for i in insns))
    prog = SockFprog(len(insns), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


if __name__ == "__main__":
    install()
    os.execvp(sys.argv[1], sys.argv[1:])
