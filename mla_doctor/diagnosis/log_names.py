"""What a log line's facts are called: the Fact a matched line gives, the format meanings, and vLLM's backend
names (enum, class, module, display text). Shared by the reader (log_reading.py) and the deciders
(log_facts.py), so neither imports the other's internals (no import cycle)."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mla_doctor.diagnosis.knowledge import load_data, load_knowledge

_KNOWLEDGE = Path(__file__).with_name("knowledge")
MEANINGS_FILE = _KNOWLEDGE / "log_meanings.yaml"


@functools.lru_cache(maxsize=1)
def load_meanings() -> dict:
    data = load_data(MEANINGS_FILE)  # libyaml, or the knowledge's pickled copy (pure-Python yaml: ~15 ms a process)
    data["_rules"] = [(re.compile(r["text"]), r) for r in data["rules"]]
    data["_reject"] = re.compile(data["not_an_attention_backend"])
    return data


@dataclass
class Fact:
    n: int                      # line number in the log (the first, for a wrapped line)
    text: str                   # the record as logged (colour and wrappers removed)
    kind: str                   # the format's meaning (attention_backend, engine, fatal, moe, ...)
    value: Optional[str]        # the backend / version / count the line states
    format: str                 # the vLLM format string it matched
    source: str                 # "vllm/<file>:<line>" of that format (newest release that has it)
    releases: List[str]         # releases whose sources hold this format
    process: Optional[str] = None
    partial: bool = False       # the line matched only the head of the format (a truncated quote)
    lines: List[int] = field(default_factory=list)   # every original line it decided from (a traceback: start, end)
    rule: Optional[str] = None  # the rule that made it a fact (fatal: which traceback form)
    role: Optional[str] = None  # a backend line's: model, drafter, encoder, indexer
    engine: Optional[str] = field(default=None, repr=False, compare=False)     # the engine its format states
    sets: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    groups: List[str] = field(default_factory=list, repr=False, compare=False)
    files: Tuple[str, ...] = field(default=(), repr=False, compare=False)     # every file its format is in

    def to_dict(self) -> dict:
        out = {"line": self.n, "text": self.text, "kind": self.kind, "value": self.value,
               "format": self.format, "source": self.source, "releases": self.releases,
               "process": self.process, "partial": self.partial}
        if self.lines and self.lines != [self.n]:
            out["lines"] = list(self.lines)
        if self.rule:
            out["rule"] = self.rule
        if self.role:
            out["role"] = self.role
        return out


@functools.lru_cache(maxsize=1)
def display_names() -> Dict[str, str]:
    """Display text -> enum name, as each release's platform code pairs its ``Using <text> backend`` line with
    the backend it returns (``knowledge/backend_display_names.json``, tools/gen_backend_names.py): the name most
    sites give, among those sharing a word with the text."""
    try:
        with open(_KNOWLEDGE / "backend_display_names.json", encoding="utf-8") as f:
            doc = json.load(f)["names"]
    except (OSError, ValueError, KeyError):
        return {}
    out = {}
    for text, names in doc.items():
        flat = re.sub(r"[^A-Z]", "", text.upper()).replace("ATTENTION", "ATTN")

        def score(item: Tuple[str, dict], flat: str = flat) -> Tuple[int, int]:
            return (sum(1 for part in item[0].split("_") if part and part in flat), item[1]["sites"])

        best = max(names.items(), key=score)
        if score(best)[0]:
            out[text] = best[0]
    return out


@functools.lru_cache(maxsize=1)
def backend_code_names() -> Tuple[Dict[str, str], Dict[str, str]]:
    """(backend class -> enum, backend module -> enum), from the releases' AttentionBackendEnum registries."""
    try:
        with open(_KNOWLEDGE / "backend_display_names.json", encoding="utf-8") as f:
            doc = json.load(f)
        return dict(doc.get("classes") or {}), dict(doc.get("modules") or {})
    except (OSError, ValueError):
        return {}, {}


def backend_name(raw: Optional[str], aliases: Optional[Dict[str, str]] = None) -> Optional[str]:
    """vLLM's enum name for a backend as a line prints it: the enum (``AttentionBackendEnum.X``), its
    ``get_name()``, or the platform's display text (``Torch SDPA`` -> TORCH_SDPA)."""
    if not raw:
        return None
    name = raw.strip().strip("'\"")
    m = re.match(r"<?(?:AttentionBackendEnum|_Backend|Backend)\.(\w+)", name)
    if m:
        name = m.group(1)
    names = load_meanings().get("names") or {}
    if aliases is None:
        aliases = load_knowledge().data.get("backend_aliases") or {}
    got = aliases.get(name) or names.get(name) or display_names().get(name)
    if got:
        return got
    classes = backend_code_names()[0]
    if name in classes:
        return classes[name]
    stem = re.sub(r"(?:MetadataBuilder|Backend|Impl|Metadata)$", "", name)
    if stem != name and stem + "Backend" in classes:   # CutlassMLAMetadataBuilder -> CutlassMLABackend
        return classes[stem + "Backend"]
    if name.endswith("_VLLM_V1"):   # 0.7-0.9's V1 enum spelling; the knowledge keys the backend without it
        return aliases.get(name[:-8]) or name[:-8]
    up = re.sub(r"[\s-]+", "_", name.upper())
    if up != name and up in _known_enums():   # an older release's display text spelled like the enum ("Flashinfer")
        return up
    return name


@functools.lru_cache(maxsize=1)
def _known_enums() -> frozenset:
    """Every backend enum name the shipped data knows (registries, display names, meanings, aliases)."""
    classes, modules = backend_code_names()
    names = load_meanings().get("names") or {}
    aliases = load_knowledge().data.get("backend_aliases") or {}
    return frozenset(set(classes.values()) | set(modules.values()) | set(display_names().values())
                     | set(names.values()) | set(aliases.values()))
