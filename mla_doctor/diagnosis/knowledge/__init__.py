"""Typed access to ``vllm_releases.yaml``: what MLA code looks like in each vLLM release.

``load_knowledge()`` parses the YAML once; ``Knowledge.for_version("0.11.0")`` resolves every
range-keyed item for one release into a frozen ``ReleaseFacts``; ``Knowledge.agent_request()``
is the single, version-independent index request the controller sends to a host.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Pattern, Tuple, Union

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mla_doctor import user_cache

DATA_FILE = Path(__file__).with_name("vllm_releases.yaml")

__all__ = [
    "Entry", "Threshold", "Backend", "Gate", "LogFormat", "CudagraphDefault", "Forcing", "DsaModule",
    "ReleaseFacts", "Knowledge", "load_knowledge", "format_to_regex", "format_to_pattern", "parse_version",
    "NoDenseMha", "MaskedMha", "SparseDefault",
]


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Entry:
    """A code location: ``symbol`` (``Class.method``) defined in ``vllm/<def_file or file>``."""
    role: str
    file: str
    symbol: str
    engine: Optional[str] = None
    backend: Optional[str] = None
    def_file: Optional[str] = None  # where the def really is when inherited from another module
    note: str = ""

    @property
    def def_path(self) -> str:
        return self.def_file or self.file


@dataclass(frozen=True)
class Threshold:
    """``reorder_batch_threshold``: queries of at most ``value`` tokens take the decode (MQA) path.

    ``value`` is an int, or ``{platform: {local_heads: n, "default": n}}`` when it depends on heads."""
    value: Union[int, Mapping[str, Mapping[Any, int]]]
    file: str
    pattern: str
    symbol: str
    note: str = ""


@dataclass(frozen=True)
class Backend:
    name: str
    sparse: bool
    aliases: Tuple[str, ...]
    get_name: Optional[str]
    decode: Tuple[Entry, ...]           # one per engine that has this backend in this release
    prefill: Optional[Entry]            # backend-specific forward_mha override, if any
    threshold: Optional[Threshold]
    cudagraph: Optional[str]            # AttentionCGSupport of its metadata builder
    note: str = ""

    @property
    def file(self) -> str:
        return self.decode[0].file


@dataclass(frozen=True)
class Gate:
    kind: str
    file: str
    pattern: str
    text: str
    symbol: Optional[str] = None


@dataclass(frozen=True)
class LogFormat:
    id: str
    kind: str
    format: str
    file: str
    backend: Optional[str] = None
    engine: Optional[str] = None
    level: str = "INFO"
    prefix: bool = False  # the format is only the start of the logged message

    @property
    def regex(self) -> Pattern[str]:
        return format_to_regex(self.format, anchored=not self.prefix)


@dataclass(frozen=True)
class CudagraphDefault:
    mode: str
    full_decode: bool
    text: str = ""
    file: Optional[str] = None
    pattern: Optional[str] = None


@dataclass(frozen=True)
class Forcing:
    env: bool
    cli: bool
    text: str


@dataclass(frozen=True)
class DsaModule:
    module: str
    architectures: Tuple[str, ...]
    always_sparse: bool = False
    asserts_index_topk: Tuple[str, ...] = ()


@dataclass(frozen=True)
class NoDenseMha:
    """A sparse impl without a dense-MHA prefill (every token to forward_mqa), when ``when`` holds."""
    backend: str
    file: str
    symbol: str
    text: str
    when: Mapping[str, Any] = field(default_factory=dict)   # sm / kv / sinks / qk_rope_head_dim


@dataclass(frozen=True)
class MaskedMha:
    """0.27+: a sparse prefill longer than index_topk still runs forward_mha (FA4 + top-k mask) when the GPU,
    FA version, KV dtype and model dims allow and the backend's row for the TP size admits the prompt."""
    sm: int
    fa_version: int
    kv: str
    dims: Tuple[Tuple[int, ...], ...]      # (heads total, kv_lora_rank, qk_nope, qk_rope, v_head)
    rows: Mapping[Tuple[int, int], Mapping[str, Mapping[int, Tuple[Tuple[int, int], ...]]]]
    aliases: Mapping[str, str]
    file: str
    symbol: str
    note: str = ""


@dataclass(frozen=True)
class SparseDefault:
    """The CUDA platform's first sparse backend when ``when`` holds (sm / kv / max_local_heads)."""
    when: Mapping[str, Any]
    pick: str
    note: str = ""


@dataclass(frozen=True)
class ReleaseFacts:
    version: str                      # as given
    release: Optional[str]            # the base release used for matching (0.11.0rc1 -> 0.11.0)
    known: bool                       # inside the table (oldest_known .. newest_known release line)
    nearest: Optional[str]            # nearest inspected release
    engines: Tuple[str, ...]
    default_engine: Optional[str]
    engine_note: str
    dispatch: Optional[Entry]         # entries of the default engine
    prefill: Optional[Entry]
    decode_common: Optional[Entry]
    other_engine_entries: Tuple[Entry, ...]
    metadata_split: Optional[Entry]
    backends: Tuple[Backend, ...]
    cudagraph: Optional[CudagraphDefault]
    full_decode_support: Tuple[str, ...]
    forcing: Optional[Forcing]
    sparse_gates: Tuple[Gate, ...]
    sparse_mode: str
    sparse_routing: str
    dsa_modules: Tuple[DsaModule, ...]
    mla_model_types: frozenset
    eagle_targets: frozenset
    model_types_where: Optional[Entry]
    compress_ratios_head_dim: bool
    not_causal_disables: bool
    not_mla_notes: Mapping[str, str]
    never_patch: Tuple[Entry, ...]
    logs: Tuple[LogFormat, ...]
    fatal_patterns: Tuple[Tuple[str, str], ...]
    backend_aliases: Mapping[str, str]
    cudagraph_mode_values: Mapping[str, str]
    no_dense_mha: Tuple[NoDenseMha, ...] = ()
    masked_mha: Optional[MaskedMha] = None
    sparse_defaults: Tuple[SparseDefault, ...] = ()
    families: Tuple[Mapping[str, Any], ...] = ()     # model-private attention families (vllm/models/<family>/)

    def backend(self, name: str) -> Optional[Backend]:
        for b in self.backends:
            if b.name == name:
                return b
        return None


# --------------------------------------------------------------------------- helpers

_FMT_TOKEN = re.compile(r"%%|%[-+ #0]*\d*(?:\.\d+)?[sdifrx]|\{[^{}]*\}")


@functools.lru_cache(maxsize=None)
def format_to_regex(fmt: str, anchored: bool = True) -> Pattern[str]:
    """Compile a logger format (``%s``, ``%d``, ``%.2f``, f-string ``{expr}``) to a message regex."""
    return re.compile(format_to_pattern(fmt, anchored))


@functools.lru_cache(maxsize=None)
def format_to_pattern(fmt: str, anchored: bool = True) -> str:
    """`format_to_regex`'s pattern as text: what the agent is sent needs no compiled regex here (~50 compiles)."""
    out, pos = [], 0
    for m in _FMT_TOKEN.finditer(fmt):
        out.append(re.escape(fmt[pos:m.start()]))
        tok = m.group()
        if tok == "%%":
            out.append("%")
        elif tok[-1] in "di":
            out.append(r"(-?\d+)")
        elif tok[-1] == "f":
            out.append(r"(-?[\d.]+|nan|inf)")
        else:
            out.append(r"(.*?)")
        pos = m.end()
    out.append(re.escape(fmt[pos:]))
    return "^" + "".join(out) + ("$" if anchored else "")


def parse_version(version: Optional[str]) -> Optional[Version]:
    """The base release of a version string (``0.32.0+cpu`` -> 0.32.0, ``0.11.0rc1`` -> 0.11.0)."""
    if not version:
        return None
    try:
        return Version(Version(str(version).strip()).base_version)
    except InvalidVersion:
        m = re.match(r"v?(\d+(?:\.\d+)+)", str(version).strip())
        return Version(m.group(1)) if m else None


@functools.lru_cache(maxsize=None)
def _in(spec: Optional[str], v: Version) -> bool:
    # memoized: a release's facts ask ~2,500 times for ~400 distinct (range, version) pairs
    return _specifier(spec or "").contains(v, prereleases=True)


@functools.lru_cache(maxsize=None)
def _specifier(spec: str) -> SpecifierSet:
    return SpecifierSet(spec)


def _pick(items, v: Version):
    return [it for it in (items or []) if _in(it.get("versions"), v)]


def _one(items, v: Version):
    found = _pick(items, v)
    return found[-1] if found else None


def _entry(role: str, d: Optional[dict], **extra) -> Optional[Entry]:
    if not d:
        return None
    return Entry(role=role, file=d["file"], symbol=d["symbol"], engine=d.get("engine"),
                 def_file=d.get("def_file"), note=d.get("note") or d.get("why", ""), **extra)


def _masked_mha(d: Optional[dict], v: Version) -> Optional[MaskedMha]:
    if not d:
        return None
    dims = [tuple(x) for x in d.get("dims") or []]
    for since, more in (d.get("dims_from") or {}).items():  # rows a later release of the range added
        if v >= Version(str(since)):
            dims += [tuple(x) for x in more]
    rows = {}
    for key, by_backend in (d.get("rows") or {}).items():
        qk, vd = (int(x) for x in str(key).split(","))
        rows[(qk, vd)] = {b: {int(tp): tuple(tuple(r) for r in rs) for tp, rs in by_tp.items()}
                          for b, by_tp in by_backend.items()}
    return MaskedMha(sm=int(d["sm"]), fa_version=int(d["fa_version"]), kv=d.get("kv", "auto"), dims=tuple(dims),
                     rows=rows, aliases=dict(d.get("aliases") or {}), file=d["file"], symbol=d["symbol"],
                     note=d.get("note", ""))


# --------------------------------------------------------------------------- knowledge

class Knowledge:
    def __init__(self, data: dict):
        self.data = data
        self._facts: Dict[Optional[str], ReleaseFacts] = {}
        self._files: Optional[list] = None  # agent_request's derived parts, made on first use
        self._log_patterns: Dict[str, str] = {}
        self.oldest = Version(data["oldest_known"])
        self.newest = Version(data["newest_known"])
        self.inspected = tuple(sorted((Version(x) for x in data.get("inspected", [])), key=lambda x: x))

    # ---- version resolution
    def _known(self, v: Version) -> bool:
        return self.oldest.release[:2] <= v.release[:2] <= self.newest.release[:2]

    def _nearest(self, v: Version) -> Optional[str]:
        if not self.inspected:
            return None
        below = [x for x in self.inspected if Version(x.base_version) <= v]
        return str(below[-1] if below else self.inspected[0])

    def setting_args(self, version: Optional[str], name: str, value: str) -> list:
        """The command-line arguments that set ``name`` on/off in this release (ValueError if unknown)."""
        table = self.data.get("server_settings") or {}
        if name not in table:
            raise ValueError(f"unknown server setting {name!r} (known: {', '.join(sorted(table))})")
        want = {"on": "on", "true": "on", "yes": "on", "1": "on", "off": "off", "false": "off", "no": "off",
                "0": "off"}.get(str(value).strip().lower())
        if want is None:
            raise ValueError(f"setting {name}={value!r}: use on or off")
        v = parse_version(version)
        found = _one(table[name], v) if v is not None else (table[name][-1] if table[name] else None)
        if found is None:
            raise ValueError(f"setting {name} is not known for vLLM {version}")
        return list(found.get(want) or [])

    def server_setting_names(self) -> list:
        return sorted(self.data.get("server_settings") or {})

    def for_version(self, version: Optional[str]) -> ReleaseFacts:
        """The release's facts; one evaluation per version string per process (a fleet of hosts on one
        release asked for it per host: ~10 ms of controller CPU each). ReleaseFacts is frozen."""
        facts = self._facts.get(version)
        if facts is None:
            facts = self._facts[version] = self._for_version(version)  # a race computes it twice, no more
        return facts

    def _for_version(self, version: Optional[str]) -> ReleaseFacts:
        v = parse_version(version)
        known = v is not None and self._known(v)
        if v is None:  # unreadable version: best effort as the newest known release
            v = self.newest
        d = self.data
        eng = _one(d.get("engines"), v) or {}
        default = eng.get("default")

        def by_engine(role, items):
            found = [_entry(role, it) for it in _pick(items, v)]
            main = [e for e in found if e.engine in (None, default)]
            return (main[-1] if main else None), tuple(e for e in found if e.engine not in (None, default))

        dispatch, o1 = by_engine("dispatch", d.get("dispatch"))
        prefill, o2 = by_engine("prefill", d.get("prefill"))
        decode_common, o3 = by_engine("decode_common", d.get("decode_common"))
        split, o4 = by_engine("metadata_split", d.get("metadata_split"))

        backends = []
        for b in d.get("backends", []):
            dec = tuple(Entry(role="decode", file=it["file"], symbol=it["symbol"], engine=it.get("engine"),
                              backend=b["name"], def_file=it.get("def_file"), note=it.get("note", ""))
                        for it in _pick(b.get("decode"), v))
            if not dec:
                continue
            dec = tuple(sorted(dec, key=lambda e: e.engine != default))  # default engine first
            thr = _one(b.get("threshold"), v)
            cg = _one(b.get("cudagraph"), v)
            gn = _one(b.get("get_name"), v)
            pre = _one(b.get("prefill"), v)
            backends.append(Backend(
                name=b["name"], sparse=bool(b.get("sparse")), aliases=tuple(b.get("aliases") or ()),
                get_name=gn["value"] if gn else None, decode=dec,
                prefill=_entry("prefill", pre, backend=b["name"]) if pre else None,
                threshold=Threshold(value=thr["value"], file=thr["file"], pattern=thr["pattern"],
                                    symbol=thr["symbol"], note=thr.get("note", "")) if thr else None,
                cudagraph=cg["support"] if cg else None, note=b.get("note", "")))

        cgd = _one(d.get("cudagraph_default"), v)
        fc = _one(d.get("backend_forcing"), v)
        sp = d.get("sparse") or {}
        routing = _one(sp.get("routing"), v) or {}
        mt = d.get("mla_model_types") or {}
        types = frozenset(t for it in _pick(mt.get("types"), v) for t in it["types"])
        eagle = frozenset(t for it in _pick(mt.get("eagle_targets"), v) for t in it["types"])
        where = _one(mt.get("where"), v)
        logs = tuple(LogFormat(id=it["id"], kind=it["kind"], format=it["format"], file=it["file"],
                               backend=it.get("backend"), engine=it.get("engine"), level=it.get("level", "INFO"),
                               prefix=bool(it.get("prefix"))) for it in _pick(d.get("logs"), v))
        return ReleaseFacts(
            version=str(version) if version is not None else "", release=str(parse_version(version) or "") or None,
            known=known, nearest=self._nearest(v),
            engines=tuple(eng.get("engines") or ()), default_engine=default, engine_note=eng.get("note", ""),
            dispatch=dispatch, prefill=prefill, decode_common=decode_common,
            other_engine_entries=o1 + o2 + o3 + o4, metadata_split=split, backends=tuple(backends),
            cudagraph=CudagraphDefault(mode=cgd["mode"], full_decode=bool(cgd["full_decode"]),
                                       text=cgd.get("text", ""),
                                       file=cgd.get("file") if _in(cgd.get("pattern_versions"), v) else None,
                                       pattern=cgd.get("pattern") if _in(cgd.get("pattern_versions"), v) else None)
            if cgd else None,
            full_decode_support=tuple(d.get("full_decode_support") or ()),
            forcing=Forcing(env=bool(fc["env"]), cli=bool(fc["cli"]), text=fc["text"]) if fc else None,
            sparse_gates=tuple(Gate(kind=g["kind"], file=g["file"], pattern=g["pattern"], text=g.get("text", ""),
                                    symbol=g.get("symbol")) for g in _pick(sp.get("gates"), v)),
            sparse_mode=routing.get("mode", "none"), sparse_routing=routing.get("text", ""),
            dsa_modules=tuple(DsaModule(module=m["module"], architectures=tuple(m.get("architectures") or ()),
                                        always_sparse=bool(m.get("always_sparse")),
                                        asserts_index_topk=tuple(m.get("asserts_index_topk") or ()))
                              for m in _pick(sp.get("dsa_modules"), v)),
            mla_model_types=types, eagle_targets=eagle,
            model_types_where=_entry("model_types", where),
            compress_ratios_head_dim=_in(mt.get("compress_ratios_head_dim", "<0"), v),
            not_causal_disables=_in(mt.get("not_causal_disables", "<0"), v),
            not_mla_notes=dict(mt.get("not_mla_notes") or {}),
            never_patch=tuple(_entry("never_patch", it, ) for it in _pick(d.get("never_patch"), v)),
            logs=logs, fatal_patterns=tuple((d.get("fatal_patterns") or {}).items()),
            backend_aliases=dict(d.get("backend_aliases") or {}),
            cudagraph_mode_values=dict(d.get("cudagraph_mode_values") or {}),
            no_dense_mha=tuple(NoDenseMha(backend=it["backend"], file=it["file"], symbol=it["symbol"],
                                          text=it.get("text", ""), when=dict(it.get("when") or {}))
                               for it in _pick(sp.get("no_dense_mha"), v)),
            masked_mha=_masked_mha(_one(sp.get("masked_mha"), v), v),
            sparse_defaults=tuple(SparseDefault(when=dict(it.get("when") or {}), pick=it["pick"],
                                                note=it.get("note", ""))
                                  for it in _pick(sp.get("default_backend"), v)),
            families=tuple(dict(it) for it in _pick(d.get("families"), v)),
        )

    # ---- the one request sent to every host
    def all_files(self) -> list:
        d, files = self.data, []

        def add(items):
            for it in items or []:
                for k in ("file", "def_file"):
                    if it.get(k) and it[k] not in files:
                        files.append(it[k])

        for key in ("dispatch", "prefill", "decode_common", "metadata_split", "cudagraph_default", "never_patch"):
            add(d.get(key))
        for b in d.get("backends", []):
            for key in ("decode", "prefill", "threshold"):
                add(b.get(key))
        add((d.get("sparse") or {}).get("gates"))
        add((d.get("mla_model_types") or {}).get("where"))
        return files

    def log_patterns(self) -> Dict[str, str]:
        """Unanchored regexes (``search`` on raw log lines) for every known log format + crash lines."""
        out: Dict[str, str] = {}
        for it in self.data.get("logs", []):
            rx = format_to_pattern(it["format"], anchored=False)[1:]
            key, n = it["id"], 1
            while key in out and out[key] != rx:
                n += 1
                key = "%s_%d" % (it["id"], n)
            out[key] = rx
        out.update({"fatal_" + k: v for k, v in (self.data.get("fatal_patterns") or {}).items()})
        return out

    def threshold_files(self) -> list:
        """The backend files whose decode thresholds the agent reads as the code states them."""
        files: list = []
        for b in self.data.get("backends", []):
            for it in b.get("threshold") or []:
                if it.get("file") and it["file"] not in files:
                    files.append(it["file"])
        return files

    def agent_request(self) -> dict:
        """A fresh dict each call (callers may change it), derived from the data once per Knowledge."""
        agent = self.data.get("agent") or {}
        if self._files is None:  # a race derives them twice, no more
            self._files, self._log_patterns = self.all_files(), self.log_patterns()
        return {"symbols": list(agent.get("symbols") or []),
                "index": {"files": list(self._files), "patterns": dict(agent.get("patterns") or {})},
                "log_patterns": dict(self._log_patterns)}


def load_data(path: Path) -> Any:
    """A knowledge YAML file's data, from a pickled copy keyed by the file's sha256 when one is kept: libyaml
    still costs ~13 ms for vllm_releases.yaml, unpickling the same data ~0.4 ms. Content-addressed, so an
    edited file is read afresh. (Pickle, not JSON: the per-head tables have int keys.)"""
    raw = path.read_bytes()

    def parse() -> Any:
        import yaml

        # libyaml's loader when PyYAML has it (same safe subset, ~10x faster), else the pure-Python one
        return yaml.load(raw.decode("utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506

    return user_cache.pickled("knowledge", "MLA_DOCTOR_KNOWLEDGE_CACHE", hashlib.sha256(raw).hexdigest(), parse)


@functools.lru_cache(maxsize=1)
def load_knowledge() -> Knowledge:
    return Knowledge(load_data(DATA_FILE))
