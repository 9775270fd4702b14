"""Make sure this machine has a gdb that `run --method attach` can use, for the demo and the test tiers.

The agent takes the first root-owned gdb (inject.GDB_PATHS) whose injected call leaves a throwaway process
alive (inject.choose_gdb). Debian 12's gdb 13 fails that on a CPU with AMX (it cannot write the register state
back: "Couldn't write extended state status: Bad address", and the process it called into dies). Then, as root,
this installs gdb 18 from PyPI's `gdb-for-pwndbg` wheel into /opt/mla-doctor-gdb and a root-owned wrapper
/usr/local/bin/gdb, and checks again. Exit 0 when a usable gdb is there at the end, else 1 with the reasons.
Run from the repository root: python3 tools/ensure_gdb.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mla_doctor" / "agent" / "attach"))
import inject  # noqa: E402  (stdlib only: the agent's own gdb choice, not a copy of it)

PIN = "gdb-for-pwndbg==18.1.0.post1"
HOME = Path("/opt/mla-doctor-gdb")
WRAPPER = Path("/usr/local/bin/gdb")
LIBPYTHON = Path("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")  # what that build links


def install() -> None:
    if not LIBPYTHON.exists():
        subprocess.run(["apt-get", "install", "-y", "-qq", "libpython3.11"], check=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--upgrade", "--target", str(HOME), "--only-binary=:all:", "--implementation", "cp",
                    "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", PIN], check=True)
    vendor = HOME / "gdb_for_pwndbg" / "_vendor"
    WRAPPER.write_text("#!/bin/sh\n# installed by mla-doctor's tools/ensure_gdb.py (%s)\nexec %s --data-directory=%s "
                       "\"$@\"\n" % (PIN, vendor / "bin" / "gdb", vendor / "share" / "gdb"))
    os.chmod(WRAPPER, 0o755)


def main() -> int:
    gdb, unfit = inject.choose_gdb()
    if gdb is None and os.geteuid() == 0 and sys.platform == "linux" and os.uname().machine == "x86_64":
        print("no usable gdb (%s): installing %s as %s" % ("; ".join(unfit) or "none installed", PIN, WRAPPER),
              flush=True)
        install()
        inject._CHOSEN.clear()
        gdb, unfit = inject.choose_gdb()
    if gdb is None:
        print("no gdb here can attach: %s" % ("; ".join(unfit) or "none installed"), file=sys.stderr)
        return 1
    print("gdb for attach: %s" % gdb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
