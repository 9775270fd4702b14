"""Which dynamic symbols an ELF file defines, read from its section headers (stdlib only, bounded).

Used before any ptrace: an interpreter without Py_AddPendingCall/PyRun_SimpleString in its dynamic
symbol table cannot be attached to by name, and one without any CPython symbol is not a CPython.
"""
from __future__ import annotations

import os
import stat
import struct

MAX_TABLE = 64 << 20  # a symbol or string table larger than this is not read (a hostile file)
MAX_FILE = 2 << 30  # a libpython or python executable: tens of MiB


class ElfError(Exception):
    pass


def defined_symbols(path, wanted):
    """The subset of `wanted` (names) that `path` defines in its .dynsym (ELF64 little-endian only)."""
    wanted = set(wanted)
    # the interpreter's files are the service user's: a FIFO or device put there must not hang or feed us, so
    # opened non-blocking and checked on the descriptor (callers pass /proc/PID/map_files/..., the very file the
    # process mapped, never a name it controls)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ElfError("%s is not a regular file" % path)
    if st.st_size > MAX_FILE:
        os.close(fd)
        raise ElfError("%s is larger than %d bytes: not read" % (path, MAX_FILE))
    with os.fdopen(fd, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            raise ElfError("%s is not an ELF file" % path)
        if head[4] != 2 or head[5] != 1:
            raise ElfError("%s: only 64-bit little-endian ELF is read" % path)
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        if shentsize != 64 or not 0 < shnum < 4096:
            raise ElfError("%s: unexpected section header table" % path)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        if len(table) < shentsize * shnum:
            raise ElfError("%s: truncated section headers" % path)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * 64) for i in range(shnum)]
        found = set()
        for sh in sections:
            if sh[1] != 11:  # SHT_DYNSYM
                continue
            link = sh[6]
            if link >= shnum:
                raise ElfError("%s: bad .dynsym link" % path)
            strtab = sections[link]
            if sh[5] > MAX_TABLE or strtab[5] > MAX_TABLE:
                raise ElfError("%s: symbol table too large" % path)
            f.seek(sh[4])
            syms = f.read(sh[5])
            f.seek(strtab[4])
            strs = f.read(strtab[5])
            for off in range(0, len(syms) - 23, 24):
                name_off, _info, _other, shndx = struct.unpack_from("<IBBH", syms, off)
                if shndx == 0 or name_off >= len(strs):
                    continue  # undefined: imported, not provided
                end = strs.find(b"\0", name_off)
                name = strs[name_off:end if end >= 0 else len(strs)].decode("ascii", "replace")
                if name in wanted:
                    found.add(name)
        return found
