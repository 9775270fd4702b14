"""Parse results of the named source files kept on the controller, keyed by the file's sha256 (content-
addressed, so a hit is always the answer `ast` would give) and the agent's Python major.minor (the grammar
that parsed it: a newer file may not parse on an older interpreter, whose answer then differs).

Before a static audit the plan carries, per named file, the 16-hex-digit prefixes of the digests known here
(`index.known`: {"3.11": {rel: {prefix: [qualified names whose leaf is searched]}}}); the agent hashes each
named file anyway, and where its digest's prefix is known it sends `parser: "cached"` instead of parsing
(the names let it still decide which symbols need the tree-wide search). 64 bits keep the plan small; the
merge looks the FULL digest up, so a prefix collision (about 2^-64 per pair, and it would take a
second-preimage search to make one) is an error on that file, never a wrong answer. After the answer, what
the agent parsed itself is stored. Directory: $MLA_DOCTOR_PARSE_CACHE, else <$MLA_DOCTOR_CACHE or
~/.cache/mla-doctor>/parse; "off" disables it, and so does a directory another user may write to (user_cache).
Entries live under py<major.minor>-<tag>, the tag being the agent parser's own source (`tag`), are written
atomically and never changed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from mla_doctor import user_cache
from mla_doctor.remote.bundle import agent_source

PREFIX = 16
_lock = threading.Lock()


def cache_dir() -> Path | None:
    # what is read back is believed: a private directory only (user_cache), else no cache
    return user_cache.directory("parse", "MLA_DOCTOR_PARSE_CACHE")


@functools.lru_cache(maxsize=1)
def tag() -> str:
    """The parser's identity: the sha256 of the symbols.py the agent runs (the controller ships its own), so an
    mla-doctor whose parse rules changed never reads another version's entries."""
    src = agent_source("facts/symbols.py")
    return hashlib.sha256(src).hexdigest()[:12]


def _pydir(root: Path, pyver: str) -> Path:
    return root / f"py{pyver}-{tag()}"


@functools.lru_cache(maxsize=16)
def _names_key(symbols: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps(sorted(symbols)).encode()).hexdigest()[:12]


def _manifest(root: Path, pyver: str, symbols: list[str]) -> Path:
    # the names kept per digest are those whose leaf is searched: another symbol list, another manifest
    return _pydir(root, pyver) / f"files-{_names_key(tuple(symbols))}.json"


def _read_json(path: Path) -> Any:
    # by descriptor, from a private directory only, this user's regular file (user_cache.read_bytes)
    return user_cache.read_json(path)


_entries: dict[Path, dict] = {}
_manifests: dict[Path, tuple[tuple[int, int, int], Any]] = {}


def _entry(path: Path) -> dict | None:
    """A stored parse, read once per process: entries are content-addressed and never changed, and a fleet
    of hosts on one release asks for the same ones per host. Callers copy before they change anything."""
    got = _entries.get(path)
    if got is None:
        got = _read_json(path)
        if not isinstance(got, dict) or not isinstance(got.get("defs"), dict):
            return None
        _entries[path] = got
    return got


def _read_manifest(path: Path) -> Any:
    """A manifest, parsed again only when the file changed (replaced, resized or touched)."""
    try:
        st = path.stat()
    except OSError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    got = _manifests.get(path)
    if got is None or got[0] != key:
        got = _manifests[path] = (key, _read_json(path))
    return got[1]


def _write_json(path: Path, obj: Any) -> None:
    if not user_cache.ensure(path.parent):
        raise OSError("cache directory %s is not private" % path.parent)
    user_cache.write_atomic(path, json.dumps(obj, sort_keys=True).encode("utf-8"))


def known(symbols: list[str], files: list[str]) -> dict[str, Any]:
    """{pyver: {rel: {prefix: [names]}}} for the plan: the digests whose parse is stored here."""
    root = cache_dir()
    if root is None or not root.is_dir():
        return {}
    out: dict[str, Any] = {}
    wanted = frozenset(files)
    suffix = "-" + tag()
    for d in sorted(root.glob("py*" + suffix)):
        pyver = d.name[2:-len(suffix)]
        man = _read_manifest(_manifest(root, pyver, symbols))
        if isinstance(man, dict):
            # built once per manifest content and file list (a fleet asks per host); shared: never changed
            got = _known.get((pyver, wanted))
            if got is None or got[0] is not man:
                per = {rel: {sha[:PREFIX]: names for sha, names in shas.items()}
                       for rel, shas in man.items() if rel in wanted and isinstance(shas, dict)}
                got = _known[(pyver, wanted)] = (man, per)
            if got[1]:
                out[pyver] = got[1]
    return out


_known: dict[tuple[str, frozenset], tuple[Any, dict]] = {}  # (pyver, files) -> (the manifest read, its prefixes)


def merge(raw: dict[str, Any], symbols: list[str], store: bool = True) -> None:
    """Fill the files the agent answered from the cache with the stored parse; with `store`, keep what it
    parsed itself. Only this machine's agent stores (protocol.call): a remote host's answer is believed for
    its own report, but could otherwise put forged definitions under a digest other hosts share."""
    root = cache_dir()
    index = raw.get("index")
    py = (raw.get("host") or {}).get("agent_python") or []
    if root is None or not isinstance(index, dict) or len(py) < 2:
        return
    pyver = "%d.%d" % (py[0], py[1])
    pydir = _pydir(root, pyver)
    fresh, gone = {}, {}
    for rel, info in index.items():
        if not isinstance(info, dict) or not info.get("sha256"):
            continue
        sha = info["sha256"]
        if info.get("parser") == "cached":
            stored = _entry(pydir / (sha + ".json"))
            info.pop("cached", None)
            if stored is not None:
                info.update(parser="ast", defs=dict(stored["defs"]), classes=dict(stored.get("classes") or {}))
            else:  # a prefix collision, or the entry removed since the plan: said, never guessed
                info.pop("parser", None)
                info["error"] = "parse cache: no entry for sha256 %s" % sha
                gone[rel] = sha  # dropped from the manifest: the next audit parses it
        elif info.get("parser") == "ast" and store:
            fresh[rel] = (sha, info)
    if fresh or gone:
        _store(root, pyver, symbols, fresh, gone)


def _store(root: Path, pyver: str, symbols: list[str], fresh: dict[str, Any], gone: dict[str, str]) -> None:
    leaves = set(symbols)
    try:
        with _lock:  # one controller's threads; another process may lose a manifest line (a later miss), no more
            man_path = _manifest(root, pyver, symbols)
            man = _read_json(man_path)
            man = man if isinstance(man, dict) else {}
            for rel, sha in gone.items():
                (man.get(rel) or {}).pop(sha, None)
            for rel, (sha, info) in fresh.items():
                entry = _pydir(root, pyver) / (sha + ".json")
                if not entry.exists():
                    _write_json(entry, {"defs": info.get("defs") or {}, "classes": info.get("classes") or {}})
                man.setdefault(rel, {})[sha] = sorted(q for q in (info.get("defs") or {})
                                                      if q.rsplit(".", 1)[-1] in leaves)
            _write_json(man_path, man)
    except OSError:
        pass  # a read-only or full home: the audit is right without the cache, only slower next time


def store_parsed(pyver: str, symbols: list[str], index: dict[str, Any]) -> int:
    """Keep the parse of files this machine parsed itself (tools/gen_parse_cache.py: the corpus releases'
    sources); the number of files whose parse is now held."""
    root = cache_dir()
    fresh = {rel: (i["sha256"], i) for rel, i in index.items()
             if isinstance(i, dict) and i.get("parser") == "ast" and i.get("sha256")}
    if root is not None and fresh:
        _store(root, pyver, symbols, fresh, {})
    return len(fresh) if root is not None else 0
