"""The log formats harvested from each vLLM module (agent/facts/log_formats.py), kept on the controller keyed by
the module's sha256 (content-addressed, so a hit is what harvesting that very content gives), the agent's
Python major.minor (the grammar that parsed it) and the harvester's own source (other keywords or rules,
another answer: `tag`).

Where a server log is found the agent harvests ~800 modules of a 0.33 install (~0.5 s of CPU). The plan
carries the 16-hex-digit prefixes of the digests held here (`formats_known`: {"3.11": [prefix, ...]}); the
agent takes each module's digest from the integrity pass (hashing only where it made none), does not read a
module whose prefix is known and answers its full digest (`formats.cached`: {rel: sha256}); `merge` looks the
FULL digest up (a prefix collision is an error, never a wrong answer: the installed formats are then dropped
for this audit and the shipped ones read the log) and puts the stored formats back, so the answer is the one
a full harvest gives. Only this machine's agent (`--local`, `formats_digests`) names the digests of what it
harvested (`formats.harvested`), and only those are stored: a remote host could otherwise file forged formats
under a digest other hosts share. Under the parse cache's directory (remote/parse_cache.py), so
MLA_DOCTOR_PARSE_CACHE=off turns this off too.

Layout: <parse cache>/formats/py<major.minor>-<tag>/manifest.json ({sha256: pack}) and packs/<pack>.json
({sha256: [[line, level[:exc], format], ...]}): one pack per stored answer (a release's modules), so a hit
reads the manifest and one or two packs rather than ~800 small files. Written atomically, never changed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from mla_doctor.agent.facts.log_formats import PREFIX, compact, expand, order
from mla_doctor.remote.bundle import agent_source
from mla_doctor.remote.parse_cache import _read_json, _read_manifest, _write_json, cache_dir

_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def tag() -> str:
    """The harvester's identity: the sha256 of the log_formats.py the agent runs (the controller ships its own)."""
    src = agent_source("facts/log_formats.py")
    return hashlib.sha256(src).hexdigest()[:12]


def _dir(root: Path, pyver: str) -> Path:
    return root / "formats" / f"py{pyver}-{tag()}"


def _manifest(d: Path) -> dict[str, str]:
    """{sha256: pack} of one directory, parsed once per change of the file (a fleet reads it per host)."""
    man = _read_manifest(d / "manifest.json")
    return man if isinstance(man, dict) else {}


def known() -> dict[str, list[str]]:
    """{pyver: [prefix, ...]} for the plan: the digests whose formats are held here, for this harvester."""
    root = cache_dir()
    if root is None or not (root / "formats").is_dir():
        return {}
    out = {}
    suffix = "-" + tag()
    for d in sorted((root / "formats").glob("py*" + suffix)):
        man = _manifest(d)
        if man:
            got = _prefixes.get(d)  # once per manifest content (a fleet asks per host); shared: never changed
            if got is None or got[0] is not man:
                got = _prefixes[d] = (man, sorted({sha[:PREFIX] for sha in man}))
            out[d.name[2:-len(suffix)]] = got[1]
    return out


_prefixes: dict[Path, tuple[dict, list[str]]] = {}  # directory -> (the manifest read, its digest prefixes)


def plan_fields(local: bool) -> dict[str, Any]:
    """What a static plan carries for this cache: the prefixes held; for an agent of this machine, the ask to
    name what it harvests (stored after the answer)."""
    if cache_dir() is None:
        return {}
    fields: dict[str, Any] = {}
    held = known()
    if held:
        fields["formats_known"] = held
    if local:
        fields["formats_digests"] = True
    return fields


def merge(raw: dict[str, Any], store: bool = True) -> None:
    """Put the stored formats of the modules the agent left to this cache back into `log.formats`; with
    `store`, keep what it harvested itself. The merged `formats` is the one a full harvest answers."""
    log = raw.get("log")
    doc = log.get("formats") if isinstance(log, dict) else None
    if not isinstance(doc, dict):
        return
    cached, fresh = doc.pop("cached", None), doc.pop("harvested", None)
    if not cached and not fresh:
        return
    py = (raw.get("host") or {}).get("agent_python") or []
    root = cache_dir()
    try:
        pyver = "%d.%d" % (py[0], py[1])
        recs = expand(doc)
    except (IndexError, TypeError, ValueError) as e:
        _drop(log, "malformed answer: %s" % e)
        return
    if cached:
        if root is None:
            _drop(log, "%d modules left to the cache, which is off" % len(cached))
            return
        d = _dir(root, pyver)
        held = _lookup(d, cached)
        missing = sorted(rel for rel in cached if rel not in held)
        if missing:  # a prefix collision, or the cache changed since the plan: said, never guessed
            _forget(d, {cached[rel] for rel in missing})
            _drop(log, "no entry for sha256 %s (%s)%s" % (cached[missing[0]], missing[0],
                                                          " and %d more" % (len(missing) - 1) if len(missing) > 1
                                                          else ""))
            return
        for rel, rows in held.items():
            recs.extend(_record(rel, row) for row in rows)
        elapsed = doc.get("elapsed_s")
        doc.clear()
        doc.update(compact(order(recs)))
        if elapsed is not None:
            doc["elapsed_s"] = elapsed
    if fresh and store and root is not None and isinstance(fresh, dict):
        _store(_dir(root, pyver), fresh, recs)


def _drop(log: dict[str, Any], why: str) -> None:
    """No installed formats for this audit: the log is read with the shipped ones (as after a failed harvest)."""
    log.pop("formats", None)
    log["formats_error"] = "log-format cache: " + why


def _record(rel: str, row: list[Any]) -> dict[str, Any]:
    level, _, exc = str(row[1]).partition(":")
    rec = {"file": rel, "line": int(row[0]), "level": level, "format": str(row[2])}
    if exc:
        rec["exc"] = exc
    return rec


def _lookup(d: Path, cached: dict[str, str]) -> dict[str, list[Any]]:
    """{rel: stored rows} for the modules whose FULL digest is held."""
    man = _manifest(d)
    packs: dict[str, Any] = {}
    out = {}
    for rel, sha in cached.items():
        pack = man.get(sha) if isinstance(sha, str) else None
        if pack is None:
            continue
        if pack not in packs:
            packs[pack] = _read_json(d / "packs" / f"{pack}.json") or {}
        rows = packs[pack].get(sha) if isinstance(packs[pack], dict) else None
        if isinstance(rows, list):
            out[rel] = rows
    return out


def _rows(recs: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    by_file: dict[str, list[list[Any]]] = {}
    for r in recs:
        by_file.setdefault(r["file"], []).append(
            [r["line"], r["level"] + (":" + r["exc"] if r.get("exc") else ""), r["format"]])
    return by_file


def _store(d: Path, fresh: dict[str, str], recs: list[dict[str, Any]]) -> None:
    by_file = _rows(recs)
    entries = {sha: by_file.get(rel, []) for rel, sha in fresh.items() if isinstance(sha, str) and len(sha) == 64}
    if not entries:
        return
    blob = json.dumps(entries, sort_keys=True)
    pack = hashlib.sha256(blob.encode()).hexdigest()[:PREFIX]  # content-addressed: the same answer, one pack
    try:
        with _lock:  # one controller's threads; another process may lose a manifest line (a later miss), no more
            path = d / "packs" / f"{pack}.json"
            if not path.exists():
                _write_json(path, entries)
            man = dict(_manifest(d))
            new = {sha: pack for sha in entries if sha not in man}
            if new:
                man.update(new)
                _write_json(d / "manifest.json", man)
    except OSError:
        pass  # a read-only or full home: the audit is right without the cache, only slower next time


def _forget(d: Path, shas: set[str]) -> None:
    try:
        with _lock:
            man = dict(_manifest(d))
            gone = [sha for sha in shas if man.pop(sha, None) is not None]
            if gone:
                _write_json(d / "manifest.json", man)
    except OSError:
        pass


def store_harvested(pyver: str, recs: list[dict[str, Any]], hashed: dict[str, str]) -> int:
    """Keep the formats of modules this machine harvested itself (tools/gen_parse_cache.py: the corpus
    releases); the number of modules now held."""
    root = cache_dir()
    if root is None or not hashed:
        return 0
    _store(_dir(root, pyver), hashed, recs)
    return len(hashed)
