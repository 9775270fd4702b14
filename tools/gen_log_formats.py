#!/usr/bin/env python3
"""Regenerate ``mla_doctor/diagnosis/knowledge/log_formats.json``: the log formats of every release.

The formats are harvested from the real release sources by the agent's own harvester
(``mla_doctor/agent/facts/log_formats.py``, imported from this checkout: the agent package is stdlib-only), so
what ``explain`` matches a pasted log against is exactly what a host's installed vLLM would give.

    python tools/gen_log_formats.py                    # every release of the corpus (tests/support/corpus.py)
    python tools/gen_log_formats.py vllm==0.34.0       # add or refresh one release (downloaded once, cached)
    python tools/gen_log_formats.py path/to/vllm-0.34.0-*.whl   # or a local wheel / a dir holding vllm/
    python tools/gen_log_formats.py --check            # exit 1 when the shipped file is not what would be written

Releases given on the command line are merged into the shipped file; without arguments the corpus's
releases are regenerated and any other release already shipped is kept.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mla_doctor" / "diagnosis" / "knowledge" / "log_formats.json"
SCHEMA = 1


sys.path.insert(0, str(ROOT))
from mla_doctor.agent.facts import log_formats as harvester  # noqa: E402  (stdlib-only, like the agent)


def _corpus():
    sys.path.insert(0, str(ROOT))
    from tests.support import corpus  # noqa: E402  (the test suite's cache of release sources)
    return corpus


def release_key(dist: str, version: str) -> str:
    return f"{dist}-{version}"


def harvest_release(vllm_dir: Path) -> list:
    return harvester.harvest_tree(str(vllm_dir))


def _dist_of(tree: Path) -> tuple[str, str]:
    """(distribution, version) from the ``*.dist-info`` beside ``vllm/``."""
    for info in sorted(tree.glob("*.dist-info")):
        m = re.match(r"(.+)-([^-]+)\.dist-info$", info.name)
        if m:
            return m.group(1).replace("_", "-"), m.group(2)
    raise SystemExit(f"{tree}: no *.dist-info beside vllm/ (give a wheel or dist==version)")


def build(releases: dict) -> dict:
    """``{key: (dist, version, records)}`` -> the shipped document (formats and files stored once)."""
    formats = sorted({r["format"] for _d, _v, recs in releases.values() for r in recs})
    files = sorted({r["file"] for _d, _v, recs in releases.values() for r in recs})
    fidx = {f: i for i, f in enumerate(formats)}
    pidx = {p: i for i, p in enumerate(files)}
    doc = {"schema": SCHEMA, "generated_by": "tools/gen_log_formats.py", "formats": formats, "files": files,
           "releases": {}}
    for key in sorted(releases):
        dist, version, recs = releases[key]
        sites = [[fidx[r["format"]], pidx[r["file"]], r["line"], r["level"] + (":" + r["exc"] if r.get("exc") else "")]
                 for r in recs]
        doc["releases"][key] = {"dist": dist, "version": version, "sites": sites}
    return doc


def records(doc: dict, key: str) -> list:
    """The harvested records of one release back from the document (the inverse of ``build``)."""
    out = []
    for fi, pi, line, level in doc["releases"][key]["sites"]:
        rec = {"file": doc["files"][pi], "line": line, "level": level.split(":", 1)[0], "format": doc["formats"][fi]}
        if ":" in level:
            rec["exc"] = level.split(":", 1)[1]
        out.append(rec)
    return out


def dump(doc: dict) -> str:
    # one release per line: compact, and a diff shows which release changed
    head = {k: v for k, v in doc.items() if k != "releases"}
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False)[:-1] + ',"releases":{\n'
    text += ",\n".join(json.dumps(k) + ":" + json.dumps(v, separators=(",", ":"), ensure_ascii=False)
                       for k, v in doc["releases"].items())
    return text + "\n}}\n"


def _tree_for(arg: str, tmp: Path) -> Path:
    if "==" in arg:
        dist, version = arg.split("==", 1)
        return _corpus().ensure(dist, version)
    p = Path(arg)
    if p.suffix == ".whl":
        dest = tmp / p.stem
        with zipfile.ZipFile(p) as zf:
            for info in zf.infolist():
                top = info.filename.split("/", 1)[0]
                if top.endswith(".dist-info") or (top == "vllm" and info.filename.endswith(".py")):
                    zf.extract(info, dest)
        return dest
    if (p / "vllm").is_dir():
        return p
    raise SystemExit(f"{arg}: give dist==version, a wheel, or a directory holding vllm/ and its *.dist-info")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="*", help="dist==version, a .whl, or a directory holding vllm/")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    old = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else None
    releases = {}
    if old:
        for key, rel in old["releases"].items():
            releases[key] = (rel["dist"], rel["version"], records(old, key))
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        if args.releases:
            trees = [_tree_for(a, Path(tmp)) for a in args.releases]
        else:
            corpus = _corpus()
            trees = [corpus.ensure(d, v) for d, v in corpus.RELEASES]
        for tree in trees:
            dist, version = _dist_of(tree)
            releases[release_key(dist, version)] = (dist, version, harvest_release(tree / "vllm"))
            print(f"{dist}=={version}: {len(releases[release_key(dist, version)][2])} formats", file=sys.stderr)
    text = dump(build(releases))
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'STALE: run tools/gen_log_formats.py'}", file=sys.stderr)
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text) // 1024} KiB, {len(releases)} releases)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
