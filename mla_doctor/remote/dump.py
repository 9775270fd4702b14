"""The agent's payload exploded into files, for debugging it by hand on a host (AnsiballZ's "explode").

`write_dump(dir, plans)` writes the exact sources remote/bundle.py frames and sends (the very strings the
payload holds, so each file's bytes are what the host compiles), the bootstrap the host runs, a manifest of
their hashes, the plans given, and `run.py`: a stdlib-only, Python 3.8+ script that frames the sources it
finds beside it the way bundle.py does and runs them under `python -B -c BOOTSTRAP` with a plan on stdin,
exactly the one remote execution mla-doctor makes (remote/runner.py), minus SSH. Edit a source, rerun
run.py: it runs the edit, and says on stderr which files differ from the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from mla_doctor.agent.protocol import AGENT_VERSION, BOOTSTRAP, PACKAGE, PAYLOAD_MAGIC
from mla_doctor.errors import UsageError
from mla_doctor.remote import bundle

MANIFEST = "MANIFEST.json"
MANIFEST_KIND = "mla-doctor agent --dump"  # marks a directory this module wrote (and may write again)


@dataclass
class Dump:
    """What write_dump wrote: the directory, the source files (relative to it), the plans, the sources' sha256."""

    directory: Path
    sources: list[str] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    sources_sha256: str = ""


def sources_sha256(sources: dict[str, str]) -> str:
    """The sha256 the payload and the compiled modules are kept under (bundle._agent): of the sources' JSON."""
    return hashlib.sha256(json.dumps(sources, sort_keys=True).encode("utf-8")).hexdigest()


def _check_target(directory: Path) -> None:
    """A new or empty directory, or one an earlier dump wrote (its sources are replaced): never anything else."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise UsageError(f"{directory}: not a directory")
    _check_owned(directory)
    if not directory.exists() or not any(directory.iterdir()):
        return
    try:
        kind = json.loads((directory / MANIFEST).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != MANIFEST_KIND:
        raise UsageError(f"{directory}: not empty and not an earlier `{MANIFEST_KIND}` (no {MANIFEST} of one); "
                         "give a new or empty directory")


def _check_owned(directory: Path) -> None:
    """The dump is run as root by hand (run.py), so no other user may change it: DIR, if it exists, is ours and
    writable by no one else, and so is its parent (a sticky one such as /tmp only if root's or ours) -- else a
    local user who made DIR (or a link in it) swaps run.py, or has root write through a link they planted."""
    me = os.geteuid()
    for d, what in ((directory.absolute().parent, "its parent"), (directory, "it")):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue
        sticky = st.st_mode & stat.S_ISVTX and st.st_uid in (me, 0) and d != directory
        if st.st_uid not in (me, 0) or (st.st_mode & 0o022 and not sticky):
            raise UsageError(f"{directory}: {what} ({d}) is owned by uid {st.st_uid} with mode "
                             f"{stat.S_IMODE(st.st_mode):04o}: another user could change the dump that root runs "
                             "by hand; give a directory of your own")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # never through a link (an earlier dump's names are ours: a link there is not followed)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    except OSError as e:
        raise UsageError(f"{path}: cannot write: {e.strerror or e}") from e
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:  # newline="": the payload's bytes, untranslated
        f.write(text)
        os.fchmod(f.fileno(), mode)


def _remove_tree(root: Path) -> None:
    """An earlier dump's source tree (only files and directories it holds; a link is removed, not followed)."""
    if root.is_symlink() or root.is_file():
        root.unlink()
        return
    if not root.exists():
        return
    for child in root.iterdir():
        _remove_tree(child)
    root.rmdir()


def write_dump(directory: str | os.PathLike, plans: dict[str, dict] | None = None) -> Dump:
    """Write the payload's sources under DIR/<PACKAGE>/, DIR/bootstrap.py, DIR/run.py, DIR/README.txt,
    DIR/MANIFEST.json and each plan as DIR/plan-<name>.json."""
    root = Path(directory)
    _check_target(root)
    sources = bundle.agent_sources()
    root.mkdir(parents=True, exist_ok=True)
    _remove_tree(root / PACKAGE)
    for rel, text in sources.items():
        _write(root / PACKAGE / rel, text)
    _write(root / "bootstrap.py", BOOTSTRAP)
    _write(root / "run.py", RUN_SCRIPT, 0o755)
    written = []
    for name, plan in sorted((plans or {}).items()):
        written.append(f"plan-{name}.json")
        _write(root / written[-1], json.dumps(plan, indent=1, sort_keys=True) + "\n")
    digest = sources_sha256(sources)
    manifest = {"kind": MANIFEST_KIND, "agent_version": AGENT_VERSION, "package": PACKAGE,
                "payload_magic": PAYLOAD_MAGIC.decode("ascii"), "sources_sha256": digest,
                "files": {rel: hashlib.sha256(text.encode("utf-8")).hexdigest() for rel, text in sources.items()},
                "plans": written}
    _write(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _write(root / "README.txt", README.format(package=PACKAGE, digest=digest, plans=", ".join(written) or "none"))
    return Dump(root, [f"{PACKAGE}/{rel}" for rel in sources], written, digest)


README = """\
The mla-doctor host agent, exploded: the exact payload `mla-doctor` sends a host, as files.

{package}/
    the agent's sources: the very text mla-doctor frames and sends (the sha256 of their JSON, as the
    payload and the agent-code cache name it: {digest})
bootstrap.py
    what the host runs: python3 -B -c "$(cat bootstrap.py)", with the payload and then a plan on stdin
run.py
    frames the sources in {package}/ as remote/bundle.py does and runs the bootstrap with a plan: the one
    remote execution mla-doctor makes, minus SSH. Prints the agent's JSON answer, exits with its status.
MANIFEST.json
    each source's sha256, to tell an edited file from the shipped one
plan-*.json ({plans})
    plans to run. plan-static.json is the plan of a `static` audit (the read-only op) for the host's
    defaults; `mla-doctor agent --plan [--python P] [--model M] [--log L]` prints one for those paths.
    It carries none of the controller's cache hints (parses and log formats it already holds), so the
    agent answers in full.

Run it on a host by hand (run.py needs Python 3.8+ and nothing else):

  scp -r THIS_DIR host:/tmp/mla-agent
  ssh host python3 /tmp/mla-agent/run.py /tmp/mla-agent/plan-static.json
  ssh host sudo -n python3 /tmp/mla-agent/run.py /tmp/mla-agent/plan-static.json   # as --sudo does

  python3 run.py PLAN --debug           the answer also lists the modules loaded (a traceback on failure)
  python3 run.py --check                which sources differ from the shipped ones (exit 1 if any)
  python3 run.py --payload payload.bin  the framed payload alone:
                                        cat payload.bin PLAN | python3 -B -c "$(cat bootstrap.py)"
  /opt/vllm/bin/python run.py PLAN      the agent under that interpreter, as --python does

To debug, edit a file under {package}/ (a print to stderr, say) and rerun run.py: it frames what is on
disk, and says on stderr which files differ from the manifest. mla-doctor itself writes nothing on the
host to run the agent; this directory is only for running it by hand. `static` and `index` only read;
other plans (patch, revert, a restart) change the host as the live run would.
"""

# The hand-run script. Stdlib only, Python 3.8+ (tests/unit/test_agent_dump.py runs vermin on it): it runs on the
# host, beside the sources. The payload is framed as in remote/bundle.py: magic, 4-byte length, zlib(JSON).
RUN_SCRIPT = '''\
#!/usr/bin/env python3
"""Run the mla-doctor agent in this directory by hand: frame the sources beside this script as mla-doctor's
payload, run the bootstrap (bootstrap.py) under -B -c with the payload and a plan on stdin, print the answer.
See README.txt."""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def manifest():
    with open(os.path.join(HERE, "MANIFEST.json"), encoding="utf-8") as f:
        return json.load(f)


def sources(package):
    """{path relative to the package: source}, every .py under it, as remote/bundle.py reads them."""
    out = {}
    top = os.path.join(HERE, package)
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, top).replace(os.sep, "/")] = f.read().decode("utf-8")
    return out


def differences(man, src):
    """The sources that differ from the shipped ones: edited, added or missing."""
    shipped = man["files"]
    now = {rel: hashlib.sha256(text.encode("utf-8")).hexdigest() for rel, text in src.items()}
    return sorted(rel for rel in set(shipped) | set(now) if shipped.get(rel) != now.get(rel))


def payload(man, src):
    blob = zlib.compress(json.dumps(src, sort_keys=True).encode("utf-8"), 6)
    return man["payload_magic"].encode("ascii") + len(blob).to_bytes(4, "big") + blob


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\\n\\n")[0])
    ap.add_argument("plan", nargs="?", default=os.path.join(HERE, "plan-static.json"),
                    help="the JSON plan ('-': stdin; default: plan-static.json here)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter to run the agent (default: this one)")
    ap.add_argument("--debug", action="store_true", help="ask the agent for its modules loaded and a traceback")
    ap.add_argument("--check", action="store_true", help="only say which sources differ from the shipped ones")
    ap.add_argument("--payload", metavar="FILE", help="only write the framed payload to FILE")
    args = ap.parse_args(argv)
    man = manifest()
    src = sources(man["package"])
    diff = differences(man, src)
    if args.check:
        for rel in diff:
            print(rel)
        return 1 if diff else 0
    if diff:
        sys.stderr.write("run.py: %d source(s) differ from the shipped payload: %s\\n" % (len(diff), ", ".join(diff)))
    pay = payload(man, src)
    if args.payload:
        with open(args.payload, "wb") as f:
            f.write(pay)
        return 0
    if args.plan == "-":
        plan = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    else:
        with open(args.plan, encoding="utf-8") as f:
            plan = json.load(f)
    if args.debug:
        plan["debug"] = True
    with open(os.path.join(HERE, "bootstrap.py"), encoding="utf-8") as f:
        bootstrap = f.read()
    res = subprocess.run([args.python, "-B", "-c", bootstrap], input=pay + json.dumps(plan).encode())
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
'''
