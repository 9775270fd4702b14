"""The attention path as the installed code states it (the agent's `resolution`, agent/facts/resolve.py), read
into one family path per architecture, and checked against the knowledge (pure, no I/O).

The code decides *which* methods run (the family's layer, its split, its entries); the knowledge keeps what code
cannot say (what a condition means, thresholds, log meanings) and its own table of the model-private families
(``families`` in vllm_releases.yaml, used where no code was read: ``explain``). Where both exist and disagree,
that is a finding (``KNOWLEDGE_CODE_DISAGREE``), never resolved in the table's favour: the code's path is used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["LayerPath", "FamilyPath", "family_paths", "served_path", "family_route", "knowledge_family",
           "code_paths_section", "family_backend", "not_on_platform",
           "compare_family", "backend_findings", "probe_target_list", "served_entries", "apply_served_entries"]

_SHARED = ("model_executor/layers/", "attention/", "v1/attention/")


@dataclass
class LayerPath:
    platform: str
    cls: str
    file: str
    line: int
    when: Optional[str]
    prefill: str                     # forward_mha | own | none | ?
    decode: List[str]                # "Class.method (vllm/file:line)" or "impl.forward_mqa (the backend's)"
    prefill_refs: List[str]
    dispatch: List[str]
    generic: bool                    # the shared MLA layer (MLAAttention / Attention): the knowledge's path applies
    through: Optional[str] = None    # a VL wrapper's language model: "Arch (vllm/file:line)", the registry call
    # the backend the layer names itself (`backend_cls = X`, `get_attn_backend()`): {name, class, ref, get_name,
    # named_by, named_at}; it wins over the platform's generic selection (DeepSeek V4 on CPU: CPU_V4_MLA_SPARSE)
    backend: Optional[Dict[str, Any]] = None
    other_backends: List[Dict[str, Any]] = field(default_factory=list)  # its SWA cache's, indexer's
    # the config-reading `if` tests the layer is built under (resolve.py's when_config): Kimi K3.1's DSA layer
    # only `if config.is_dsa_layer(i)` (dsa_config), its dense one otherwise
    when_config: List[Dict[str, Any]] = field(default_factory=list)

    def built_by(self, config: Optional[dict]) -> bool:
        """False when a test the layer needs true reads only config keys the served config lacks."""
        cfg = _text(config)
        if not cfg:
            return True
        for c in self.when_config:
            keys = [k for k in c.get("keys") or [] if isinstance(k, str)]
            if not c.get("negated") and keys and all(cfg.get(k) is None for k in keys):
                return False
        return True

    @property
    def decode_symbol(self) -> str:
        own = [d.split(" ", 1)[0] for d in self.decode if not d.startswith("impl.")]
        return own[0] if own else "forward_mqa"

    @property
    def prefill_symbol(self) -> Optional[str]:
        if self.prefill == "none":
            return None
        if self.prefill == "own":
            return self.prefill_refs[0].split(" ", 1)[0] if self.prefill_refs else None
        return "forward_mha"


@dataclass
class FamilyPath:
    architecture: str
    family: str
    private: bool                     # registered by fully qualified module (vllm.models.<family>)
    registry: str                     # vllm/<registry>:line (dict)
    module: str
    platform_taken: Optional[str]
    layers: List[LayerPath] = field(default_factory=list)
    # the branch the host takes builds no attention layer (a stub that raises: DeepSeek V4's VL model and MTP
    # draft on CPU): "Class (vllm/file:line)"; then nothing of another branch runs
    taken_builds_none: Optional[str] = None
    taken_raises: Optional[str] = None  # "NotImplementedError (vllm/file:line)": where that stub raises
    # layers the served config does not build (their `if` reads config keys it lacks): "Class (vllm/file:line)
    # needs <keys> (test at vllm/file:line)"
    not_built: List[str] = field(default_factory=list)

    @property
    def platforms(self) -> List[str]:
        return list(dict.fromkeys(lp.platform for lp in self.layers))

    def running(self) -> List[LayerPath]:
        """The layers of the branch the host takes, or every branch's when that is unknown."""
        if self.taken_builds_none:
            return []
        if self.platform_taken:
            mine = [lp for lp in self.layers if lp.platform == self.platform_taken]
            if mine:
                return mine
        return list(self.layers)

    @property
    def generic(self) -> bool:
        return bool(self.layers) and all(lp.generic for lp in self.running())

    @property
    def prefill(self) -> str:
        kinds = {lp.prefill for lp in self.running()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def to_dict(self) -> Dict[str, Any]:
        return {"architecture": self.architecture, "family": self.family, "private": self.private,
                "registry": self.registry, "module": self.module, "platform_taken": self.platform_taken,
                "platforms": self.platforms, "prefill": self.prefill, "generic": self.generic,
                "taken_builds_none": self.taken_builds_none, "taken_raises": self.taken_raises,
                "not_built_by_config": self.not_built,
                "layers": [{"platform": lp.platform, "class": lp.cls, "ref": "vllm/%s:%s" % (lp.file, lp.line),
                            "when": lp.when, "prefill": lp.prefill, "decode": lp.decode,
                            "prefill_entries": lp.prefill_refs, "dispatch": lp.dispatch, "generic": lp.generic,
                            "through": lp.through, "backend": lp.backend, "other_backends": lp.other_backends,
                            "when_config": lp.when_config}
                           for lp in self.layers]}


def _r(ref: Optional[dict]) -> str:
    if not ref:
        return "?"
    return "%s (vllm/%s:%s)" % (ref.get("symbol"), ref.get("file"), ref.get("line"))


def _layer(platform: str, lp: dict) -> LayerPath:
    decode, pre, disp = [], [], []
    for c in lp.get("calls") or []:
        if c.get("inside"):
            continue  # an entry's own internals (DeepSeek V4's forward_mqa calling its sparse prefill kernel)
        if c.get("via") == "impl":
            ref = "impl.%s (the backend's; called from %s)" % (c.get("entry"), _r(c.get("in")))
            (decode if c.get("role") == "decode" else pre if c.get("role") == "prefill" else disp).append(ref)
            continue
        ref = _r(c.get("target")) if c.get("target") else c.get("call", "?")
        if c.get("role") == "decode":
            decode.append(ref)
        elif c.get("role") == "prefill":
            pre.append(ref)
        else:
            disp.append(ref)
    # the shared layer, or a family's subclass of it that overrides none of its split (0.34's _MistralMLA(
    # MLAAttention), dots3's padded layer): every entry call sits in the shared files, so the shared split runs
    top = [c for c in lp.get("calls") or [] if not c.get("inside")]
    generic = str(lp.get("file") or "").startswith(_SHARED) or (
        bool(top) and not any(c.get("own") for c in top)
        and all(str((c.get("in") or {}).get("file") or "").startswith(_SHARED) for c in top))
    # resolve.py's via for a wrapped model: [Wrapper, "Arch (file:line)", Arch, ...]
    via = [str(v) for v in lp.get("via") or []]
    through = next((v.replace(" (", " (vllm/", 1) for v in via[1:2] if v.endswith(")") and " (" in v), None)
    return LayerPath(backend=_backend(lp.get("backend")),
                     other_backends=[b for b in map(_backend, lp.get("other_backends") or []) if b],
                     platform=platform, cls=str(lp.get("class")), file=str(lp.get("file")),
                     line=int(lp.get("line") or 0),
                     when=lp.get("when"), prefill=str(lp.get("prefill") or "?"), decode=list(dict.fromkeys(decode)),
                     prefill_refs=list(dict.fromkeys(pre)), dispatch=list(dict.fromkeys(disp)), generic=generic,
                     through=through, when_config=[c for c in lp.get("when_config") or [] if isinstance(c, dict)])


def _backend(b: Optional[dict]) -> Optional[Dict[str, Any]]:
    """The agent's backend item, with vllm/ refs: the class's def, its get_name() return and where it is named."""
    if not isinstance(b, dict) or not b.get("name"):
        return None
    return {"name": b["name"], "class": b.get("class"), "ref": "vllm/%s:%s" % (b.get("file"), b.get("line")),
            "get_name": "vllm/%s:%s" % (b.get("get_name_file"), b.get("get_name_line")),
            "named_by": b.get("named_by"), "named_at": "vllm/%s" % b.get("named_at")}


def family_paths(resolution: Optional[dict]) -> List[FamilyPath]:
    out = []
    for a in (resolution or {}).get("architectures") or []:
        if not isinstance(a, dict):
            continue
        reg = a.get("registry") or {}
        fp = FamilyPath(architecture=str(a.get("architecture")), family=str(a.get("family")),
                        private=bool(reg.get("private")), registry="vllm/%s:%s (%s)" % (
                            reg.get("file"), reg.get("line"), reg.get("dict")),
                        module=str(a.get("module_file")), platform_taken=a.get("platform_taken"))
        for b in a.get("branches") or []:
            for lp in b.get("layers") or []:
                fp.layers.append(_layer(str(b.get("platform")), lp))
            m = b.get("model") or {}
            if fp.platform_taken and b.get("platform") == fp.platform_taken and not b.get("layers"):
                fp.taken_builds_none = "%s (vllm/%s:%s)" % (m.get("class"), m.get("file"), m.get("line"))
                r = b.get("raises") or {}
                if r.get("file"):
                    fp.taken_raises = "%s (vllm/%s:%s)" % (r.get("exception"), r.get("file"), r.get("line"))
        out.append(fp)
    return out


def served_path(resolution: Optional[dict], config: Optional[dict]) -> Optional[FamilyPath]:
    """The family path of the served model's architecture (config.json's first), when the code was read."""
    archs = _archs(config)
    for fp in family_paths(resolution):
        if fp.architecture in archs and fp.running():
            return _built(fp, config)
    return None


def _built(fp: FamilyPath, config: Optional[dict]) -> FamilyPath:
    """The family path with only the layers the served config builds (a layer under `if config.X` whose keys
    the config lacks runs nowhere: Kimi-Linear without dsa_config has no DSA layer, hence no forward_mha)."""
    keep = [lp for lp in fp.layers if lp.built_by(config)]
    if not keep or len(keep) == len(fp.layers):
        return fp
    kept = {id(lp) for lp in keep}
    for lp in fp.layers:
        if id(lp) not in kept:
            need = next(c for c in lp.when_config if not c.get("negated")
                        and all(_text(config).get(k) is None for k in c.get("keys") or []))
            fp.not_built.append("%s (vllm/%s:%s) needs config %s (%s at vllm/%s:%s)" % (
                lp.cls, lp.file, lp.line, " or ".join(need["keys"]), str(need.get("test", "")).strip(),
                need.get("file"), need.get("line")))
    fp.layers = keep
    return fp


def _text(config: Optional[dict]) -> dict:
    """The served text config (a VL model's text_config), or {}."""
    cfg = config if isinstance(config, dict) else {}
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) and tc.get("model_type") else cfg


def _archs(config: Optional[dict]) -> List[str]:
    cfg = config if isinstance(config, dict) else {}
    archs = cfg.get("architectures") or (cfg.get("text_config") or {}).get("architectures") or []
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def family_route(fp: Optional[FamilyPath]) -> Optional[Dict[str, Any]]:
    """What routing.py reads (Known.family): per platform branch, the layer's prefill kind and its entries."""
    if fp is None or not fp.layers or fp.generic:
        return None
    by: Dict[str, Dict[str, Any]] = {}
    for lp in fp.layers:
        d = by.setdefault(lp.platform, {"prefill": lp.prefill, "decode": [], "prefill_symbol": lp.prefill_symbol,
                                        "layers": []})
        if lp.prefill != d["prefill"]:
            d["prefill"] = "mixed"
        if lp.decode_symbol not in d["decode"]:
            d["decode"].append(lp.decode_symbol)
        d["layers"].append("%s (vllm/%s:%s)" % (lp.cls, lp.file, lp.line))
    return {"family": fp.family, "architecture": fp.architecture, "source": "code", "by_platform": by,
            "platform": fp.platform_taken}


def code_paths_section(facts: Any, resolution: Optional[dict], config: Optional[dict]) -> Optional[Dict[str, Any]]:
    """The static report's `code_paths` (new key): the served family path, every resolved architecture, the
    probe targets, the backends from the code, and where the knowledge disagrees with the code."""
    if not isinstance(resolution, dict):
        return None
    fps = family_paths(resolution)
    served = served_path(resolution, config)
    disagree = compare_family(facts, served) if served is not None else []
    if served is None and resolution.get("scope") == "all_mla":
        for fp in fps:
            disagree += [dict(d, architecture=fp.architecture) for d in compare_family(facts, fp)]
    be = backend_findings(facts, resolution)
    return {"scope": resolution.get("scope"), "host_platform": resolution.get("host_platform"),
            "served": served.to_dict() if served is not None else None,
            "route_family": family_route(served),
            "architectures": [fp.to_dict() for fp in fps], "unknown_architectures": resolution.get("unknown") or [],
            "not_resolved": resolution.get("not_resolved") or [],  # past the agent's module bound (no model given)
            "probe_targets": probe_target_list(resolution),
            "backends": [{k: b.get(k) for k in ("name", "file", "class", "line", "enum", "kind", "decode", "note")}
                         for b in resolution.get("backends") or [] if isinstance(b, dict)],
            "backends_unknown_to_table": be["unknown"], "backend_decode_mismatch": be["mismatch"],
            "disagreements": disagree,
            "family_backend": family_backend(served),
            # what changes routing as the installed code states it (resolve.py's routing_code)
            "routing_code": resolution.get("routing_code"),
            "served_not_on_platform": not_on_platform(fps, config)}


_REF = re.compile(r"^(?P<symbol>[\w.]+) \((?P<file>vllm/[^:()]+):(?P<line>\d+)\)$")
ENTRY_KEYS = ("dispatch", "prefill_entry", "decode_entry")


def _symref(text: str) -> Optional[Dict[str, Any]]:
    m = _REF.match(text or "")
    if not m:
        return None
    return {"symbol": m.group("symbol"), "file": m.group("file"), "line": int(m.group("line")), "confirmed": True,
            "note": "the served family's layer, read from the installed code", "from": "code"}


def served_entries(section: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The served model's own dispatch / prefill / decode entries (issue 28, one story): what the JSON's top-level
    `static.dispatch`, `prefill_entry`, `decode_entry` say when the model is known and runs a model-private
    family's layer. None where the shared split applies (the generic entries stand). A value None: the family has
    no such entry (DeepSeek V4: no prefill entry, no dispatch); "generic": the shared entry is the one it calls
    (a layer calling impl.forward_mqa / impl.forward_mha)."""
    served = (section or {}).get("served") if isinstance(section, dict) else None
    if not isinstance(served, dict) or served.get("generic") or not served.get("layers"):
        return None
    taken = served.get("platform_taken")
    layers = [lp for lp in served["layers"] if isinstance(lp, dict)]
    # the branch the host takes; unknown (no GPU seen): the nvidia branch, named in entries_from.platform
    mine = ([lp for lp in layers if taken and lp.get("platform") == taken]
            or [lp for lp in layers if "nvidia" in str(lp.get("platform")).split("+")] or layers)
    out = _branch_entries(mine)
    plats = list(dict.fromkeys(str(lp.get("platform")) for lp in layers))
    if not taken and len(plats) > 1:
        # the host's platform is unknown and the family builds a layer per platform: the entries depend on the
        # platform, said per platform; the one shown at the top level is named as one platform's, never the host's
        per = {p: _branch_entries([lp for lp in layers if str(lp.get("platform")) == p]) for p in plats}
        out["per_platform"] = {p: {k: e[k] for k in ("layer", "alternatives") + ENTRY_KEYS} for p, e in per.items()}
        out["depends_on_platform"] = True
        for k in ENTRY_KEYS:
            if isinstance(out.get(k), dict):
                out[k] = dict(out[k], platform=out["platform"], depends_on_platform=True,
                              note="the %s branch's layer, one of %d platforms' (the host's platform is unknown: "
                                   "the entry depends on the platform, entries_from.per_platform)"
                                   % (out["platform"], len(plats)))
    return out


def _branch_entries(mine: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One platform branch's entries: its layer built unconditionally, else the selector's last."""
    own = [lp for lp in mine if not lp.get("generic")] or mine
    # several layers on one branch, chosen at run time (DeepSeek V4 nvidia: SM120, FlashInfer, FlashMLA): the one
    # built unconditionally, else the selector's last (its fall-through); the others listed as alternatives
    plain = [lp for lp in own if not lp.get("when")]
    lp = plain[0] if plain else own[-1]
    out: Dict[str, Any] = {"layer": "%s (%s)" % (lp.get("class"), lp.get("ref")), "platform": lp.get("platform"),
                           "alternatives": ["%s (%s) when %s" % (o.get("class"), o.get("ref"),
                                                                str(o.get("when") or "").strip())
                                            for o in own if o is not lp]}
    dec = [d for d in lp.get("decode") or [] if isinstance(d, str)]
    out["decode_entry"] = next((r for r in map(_symref, dec) if r), None) or ("generic" if dec else None)
    if lp.get("prefill") == "none":
        out["prefill_entry"] = None
    elif lp.get("prefill") == "own":
        out["prefill_entry"] = next((r for r in map(_symref, lp.get("prefill_entries") or []) if r), None)
    else:
        out["prefill_entry"] = "generic"
    disp = next((r for r in map(_symref, lp.get("dispatch") or []) if r), None)
    if disp is None:  # the layer's method that calls the backend's entry: "called from X (vllm/file:line)"
        called = [d.split("called from ", 1)[1].rstrip(")") + ")" for d in dec if "called from " in d]
        disp = next((r for r in map(_symref, called) if r), None)
    out["dispatch"] = disp
    return out


def apply_served_entries(static: Dict[str, Any], section: Optional[Dict[str, Any]]) -> None:
    """Make the static section's top-level entries the served model's (served_entries), the generic split kept
    under `generic_split`: text, JSON, --expect and every writer read one answer."""
    fam = served_entries(section)
    if fam is None:
        return
    static["generic_split"] = {k: static.get(k) for k in ENTRY_KEYS}
    for k in ENTRY_KEYS:
        if fam[k] != "generic":
            static[k] = fam[k]
    static["entries_from"] = {"source": "code", "layer": fam["layer"], "platform": fam["platform"],
                              "alternatives": fam["alternatives"]}
    if fam.get("depends_on_platform"):
        static["entries_from"].update(depends_on_platform=True, platform=None, shown_platform=fam["platform"],
                                      per_platform=fam["per_platform"])


def family_backend(fp: Optional[FamilyPath]) -> Optional[Dict[str, Any]]:
    """The served family layer's own backend, per platform branch (the branch the host takes, or every branch
    when that is unknown): {"platform_taken", "by_platform": {plat: [backend, ...]}}; None when no layer names
    one (the shared layer: the platform's generic selection applies)."""
    if fp is None:
        return None
    by: Dict[str, List[Dict[str, Any]]] = {}
    for lp in fp.running():
        if lp.backend:
            got = by.setdefault(lp.platform, [])
            if lp.backend["name"] not in [b["name"] for b in got]:
                got.append(dict(lp.backend, layer="%s (vllm/%s:%s)" % (lp.cls, lp.file, lp.line),
                                others=[o["name"] for o in lp.other_backends]))
    return {"platform_taken": fp.platform_taken, "by_platform": by} if by else None


def not_on_platform(fps: List[FamilyPath], config: Optional[dict]) -> Optional[Dict[str, Any]]:
    """The served architecture's branch for this host's platform builds no layer (a stub that raises):
    {architecture, family, platform, model, raises}; None otherwise."""
    archs = _archs(config)
    for fp in fps:
        if fp.architecture in archs and fp.taken_builds_none:
            return {"architecture": fp.architecture, "family": fp.family, "module": fp.module,
                    "platform": fp.platform_taken, "model": fp.taken_builds_none, "raises": fp.taken_raises}
    return None


def family_routing_text(served: Dict[str, Any]) -> str:
    """The served family's routing in one sentence, from its code path (static.code_paths.served)."""
    taken = served.get("platform_taken")
    layers = [lp for lp in served.get("layers") or [] if not taken or lp.get("platform") == taken]
    names = ", ".join(dict.fromkeys(str(lp.get("class")) for lp in layers)) or "?"
    where = "%s (vllm/%s, branch %s)" % (served.get("family"), served.get("module"), taken or "unknown")
    kind = served.get("prefill")
    if kind == "none":
        return ("%s: its layer (%s) has no forward_mha; every token, prefill included, goes through its own "
                "forward_mqa (from the installed code)" % (where, names))
    if kind == "own":
        pre = next((p for lp in layers for p in lp.get("prefill_entries") or []), "its own prefill")
        return ("%s: decode tokens through forward_mqa, prefill tokens through %s, never forward_mha (from the "
                "installed code)" % (where, pre))
    return "%s: its layer (%s) keeps the shared split (prefill %s, from the installed code)" % (where, names, kind)


def knowledge_family(facts: Any, config: Optional[dict]) -> Optional[Dict[str, Any]]:
    """The knowledge's family entry for the served architecture (where no code was read: explain)."""
    archs = _archs(config)
    for fam in getattr(facts, "families", ()) or ():
        if set(fam.get("architectures") or ()) & set(archs):
            if fam.get("prefill") == "forward_mha":
                return None  # the shared split: the knowledge's generic routing applies
            return {"family": fam.get("name"), "architecture": archs[0], "source": "knowledge",
                    "platform": None, "by_platform": {"any": {
                        "prefill": fam.get("prefill"), "decode": [fam.get("decode")],
                        "prefill_symbol": fam.get("prefill_symbol"), "layers": [fam.get("layer")]}}}
    return None


def compare_family(facts: Any, fp: FamilyPath) -> List[Dict[str, Any]]:
    """Disagreements between the knowledge's family table (and its generic entries) and the code's path."""
    out = []
    fams = getattr(facts, "families", ()) or ()
    fam = next((f for f in fams if fp.architecture in (f.get("architectures") or ())), None)
    if fam is None and fp.private:  # another architecture of a listed family (its MTP draft, a VL variant)
        fam = next((f for f in fams if f.get("name") == fp.family), None)
    plats = set(fam.get("platforms") or ()) if fam else set()
    mine = [lp for lp in fp.running() if not plats or plats & set(lp.platform.split("+"))] or fp.running()
    # a layer built only when the config says so (Kimi K3.1's DSA layers: `if config.is_dsa_layer(i)`) is the
    # code's per-layer fact; the table's one prefill kind is the family's unconditional layer's
    mine = [lp for lp in mine if not any(not c.get("negated") for c in lp.when_config)] or mine
    kinds = {lp.prefill for lp in mine}
    if fam is None:
        if fp.private and not fp.generic:
            out.append({"what": "family", "knowledge": None, "code": fp.prefill,
                        "text": "%s runs the model-private family %s (%s), which the knowledge's families table does "
                                "not list" % (fp.architecture, fp.family, fp.module)})
        elif not fp.generic and "forward_mha" not in kinds:
            pre = getattr(getattr(facts, "prefill", None), "symbol", "forward_mha")
            out.append({"what": "prefill", "knowledge": pre, "code": fp.prefill,
                        "text": "the knowledge's generic prefill entry %s is not what %s's layer runs (%s)"
                                % (pre, fp.architecture, ", ".join(lp.cls for lp in fp.running()))})
        return out
    want = fam.get("prefill")
    if want not in kinds or len(kinds) > 1:
        out.append({"what": "prefill", "knowledge": want, "code": sorted(kinds),
                    "text": "knowledge says %s's prefill is %r; the installed code shows %s"
                            % (fam.get("name"), want, ", ".join("%s: %s" % (lp.cls, lp.prefill) for lp in mine))})
    dec = str(fam.get("decode") or "").rsplit(".", 1)[-1]
    if want == "none" and dec and not any(lp.decode_symbol.rsplit(".", 1)[-1] == dec for lp in mine):
        out.append({"what": "decode", "knowledge": fam.get("decode"),
                    "code": sorted({lp.decode_symbol for lp in mine}),
                    "text": "knowledge's decode entry %s is not what the code's layers call" % fam.get("decode")})
    return out


def backend_findings(facts: Any, resolution: Optional[dict]) -> Dict[str, List[Dict[str, Any]]]:
    """{"unknown": [...], "mismatch": [...]}: backends in the code the table has never heard of, and table decode
    entries the code does not show."""
    unknown, mismatch = [], []
    table = {b.name: b for b in getattr(facts, "backends", ()) or ()}
    aliases = getattr(facts, "backend_aliases", {}) or {}
    for b in (resolution or {}).get("backends") or []:
        if not isinstance(b, dict) or b.get("kind") == "prefill":
            continue
        name = aliases.get(b.get("name"), b.get("name"))
        kb = table.get(name)
        dec = b.get("decode") or {}
        where = "vllm/%s:%s %s" % (b.get("file"), b.get("line"), b.get("class"))
        if kb is None:
            unknown.append({"name": b.get("name"), "ref": where, "decode": (
                "%s (vllm/%s:%s)" % (dec.get("symbol"), dec.get("file"), dec.get("line")) if dec else
                b.get("note") or "no decode entry found")})
            continue
        v1 = [e for e in kb.decode if e.engine != "V0"]
        if dec and v1 and not any(e.symbol.rsplit(".", 1)[-1] == str(dec.get("symbol", "")).rsplit(".", 1)[-1]
                                  for e in v1):
            mismatch.append({"name": name, "knowledge": v1[0].symbol, "code": dec.get("symbol"),
                             "ref": "vllm/%s:%s" % (dec.get("file"), dec.get("line"))})
    return {"unknown": unknown, "mismatch": mismatch}


def probe_target_list(resolution: Optional[dict]) -> List[Dict[str, Any]]:
    """The resolved probe targets as a clean list (issue 22's attach reuses it): {file, class, method, line, role,
    family, architecture, platform}; files relative to the vllm package."""
    out = []
    for t in (resolution or {}).get("probe_targets") or []:
        if isinstance(t, dict) and t.get("file") and t.get("method"):
            out.append({k: t.get(k) for k in ("file", "class", "method", "line", "role", "family", "architecture",
                                              "platform", "call_site")})
    return out
