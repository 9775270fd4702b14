"""Typed sections of a host's report (`vllm`, `static`, `model`, `server`, `log`, `gpu`, `evidence`,
`patch`, `revert`, `transport`, `timings`; the answer),
built where the report is built.

Each is a frozen dataclass: the keys readers use are attributes (with the fallback a reader wants when the key is
absent or not of its kind: `{}`, `[]`, None), and `to_dict()` gives back the JSON section exactly as it was made
or read (same keys, same order, same values, the same keys left out): `keys_` is every key present, in order,
and `extra_` holds the keys the type does not name and any typed key whose stored value is not of its kind
(a saved report's `null` where a dict belongs), as given. `from_dict` reads the agent's answer or a saved report
and never raises on a missing key; `of` is `from_dict` that gives an empty section for a missing one.

A section also reads as the JSON it serialises to (a read-only Mapping: `s["key"]`, `s.get`, `in`, `dict(s)`,
`==` with a dict), so a saved report's dict and a built report's section read alike."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

S = TypeVar("S", bound="Section")
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}  # typed key -> the kind it holds (dict, list; None: any)


class Section(Mapping):
    __slots__ = ()
    extra_: dict[str, Any]
    keys_: tuple[str, ...]

    @classmethod
    def _typed(cls) -> tuple[tuple[str, Any], ...]:
        got = _FIELDS.get(cls)
        if got is None:
            got = _FIELDS[cls] = tuple(
                (f.name, {dict: dict, list: (list, tuple)}.get(f.default_factory))
                for f in dataclasses.fields(cls) if f.name not in ("extra_", "keys_"))
        return got

    @classmethod
    def from_dict(cls: type[S], d: Mapping[str, Any] | None) -> S | None:
        """The section of an agent's answer or a saved report (None stays None: the section is absent)."""
        if d is None or isinstance(d, cls):
            return d
        d = dict(d)
        typed, extra = {}, {}
        kinds = dict(cls._typed())
        for k, v in d.items():
            if k in kinds and (kinds[k] is None or isinstance(v, kinds[k])):
                typed[k] = v
            else:
                extra[k] = v
        return cls(**typed, extra_=extra, keys_=tuple(d))

    @classmethod
    def of(cls: type[S], d: Mapping[str, Any] | None) -> S:
        """The section, or an empty one when there is none (a host that was not audited, a saved report)."""
        got = cls.from_dict(d)
        return got if got is not None else cls()

    def to_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self.keys_}

    def with_(self: S, **values: Any) -> S:
        """A copy with `values` set (new keys go last, as a dict's would)."""
        return type(self).from_dict({**self.to_dict(), **values})

    # ---- a read-only Mapping: the JSON this section serialises to
    def __getitem__(self, key: str) -> Any:
        if key in self.extra_:
            return self.extra_[key]
        if key in self.keys_:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"


def _d() -> Any:
    return field(default_factory=dict)


def _l() -> Any:
    return field(default_factory=list)


@dataclass(frozen=True, eq=False, repr=False)
class VllmSection(Section):
    """The vLLM install audited: its identity and where it was found, and the knowledge it was read with."""
    version: str | None = None
    distribution: str | None = None
    path: str | None = None  # the vllm/ directory
    site_packages: str | None = None
    python: str | None = None
    python_version: str | None = None
    located_by: str | None = None
    install_kind: str | None = None  # wheel | editable | ...
    version_source: str | None = None
    knowledge_nearest: str | None = None
    known_version: bool | None = None
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class StaticSection(Section):
    """What the installed sources state (diagnosis/static_facts.py's StaticAudit), the files checked against the
    wheel's RECORD, the side code (.pth, plugins) and the attention code that runs (code_paths)."""
    version: str | None = None
    distribution: str | None = None
    known: bool | None = None
    nearest: str | None = None
    engine: Any = None  # {"default": "V1", ...} (a release's), or a name
    dispatch: dict[str, Any] | None = None  # symbol refs: {"symbol", "file", "line", ...}
    prefill_entry: dict[str, Any] | None = None
    decode_entry: dict[str, Any] | None = None
    decode_entries: list[dict[str, Any]] = _l()
    prefill_overrides: list[dict[str, Any]] = _l()
    other_engine_entries: list[dict[str, Any]] = _l()
    sparse_gate: dict[str, Any] = _d()
    decode_thresholds: dict[str, Any] = _d()  # backend -> int, or {platform: {heads: n}}
    threshold_refs: dict[str, Any] = _d()
    full_cudagraph_decode_default: dict[str, Any] = _d()
    backend_forcing: dict[str, Any] = _d()
    metadata_split: dict[str, Any] | None = None
    never_patch: list[dict[str, Any]] = _l()
    unconfirmed: list[str] = _l()
    threshold_code: dict[str, Any] = _d()
    threshold_mismatches: list[dict[str, Any]] = _l()
    modified_files: list[str] = _l()
    instrumented_files: list[str] = _l()
    missing_files: list[str] = _l()
    unrecorded_files: list[str] = _l()
    unreadable_files: list[str] = _l()
    py_files: int | None = None
    integrity: str | None = None  # checked (a wheel's RECORD) | unknown
    code_paths: dict[str, Any] | None = None
    extra_: dict[str, Any] = _d()  # the side code's keys (pth_files, plugins), and whatever else the answer holds
    keys_: tuple[str, ...] = ()

    def symbol(self, key: str) -> str | None:
        """The symbol of a ref (`dispatch`, `prefill_entry`, `decode_entry`, `metadata_split`), if any."""
        ref = getattr(self, key)
        return ref.get("symbol") if isinstance(ref, dict) else None

    @property
    def served(self) -> dict[str, Any]:
        """code_paths.served: the layer the model's architecture resolves to ({} when not resolved)."""
        got = (self.code_paths or {}).get("served")
        return got if isinstance(got, dict) else {}


@dataclass(frozen=True, eq=False, repr=False)
class ModelSection(Section):
    """The model's config as the agent found it (the server's argv, --model) and its classification."""
    source: str | None = None  # "server argv" | "--model" | ...
    argument: str | None = None
    config: dict[str, Any] = _d()
    config_path: str | None = None
    resolved_by: str | None = None
    tried: list[Any] = _l()
    classification: dict[str, Any] = _d()  # static_facts.ModelClass as data: is_mla, is_sparse, reason, ...
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class ServerSection(Section):
    """The vLLM server the agent found (its process, settings, install), or `running: False`."""
    running: bool = False
    pid: int | None = None
    port: int | None = None
    user: str | None = None
    uid: int | None = None
    argv: list[str] = _l()
    env: dict[str, Any] = _d()
    supervisor: dict[str, Any] = _d()
    tensor_parallel_size: int | None = None
    install: dict[str, Any] = _d()
    others: list[dict[str, Any]] = _l()  # more servers: {pid, port}
    lookalikes: list[Any] = _l()
    server_error: str | None = None
    other_install: dict[str, Any] = _d()  # the server runs another install than the audited one
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class LogSection(Section):
    """The server log read: where from, and its evidence (diagnosis/static_facts.py's LogEvidence as data); or
    `source: None` and why not."""
    source: str | None = None
    total_lines: int | None = None
    evidence: dict[str, Any] = _d()
    read_via: str | None = None
    formats: dict[str, Any] = _d()  # the formats read with: {"from": "installed" | "shipped", ...}
    reason: str | None = None
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class GpuSection(Section):
    """The host's GPUs as the agent read them (nvidia-smi), or `present: False` and why not."""
    present: bool | None = None
    gpus: list[dict[str, Any]] = _l()  # {"name", "compute_cap", ...}
    reason: str | None = None
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()

    @property
    def compute_cap(self) -> str:
        """The first GPU's compute capability ("" when none is known)."""
        first = self.gpus[0] if self.gpus and isinstance(self.gpus[0], dict) else {}
        return str(first.get("compute_cap") or "")


@dataclass(frozen=True, eq=False, repr=False)
class EvidenceSection(Section):
    """A live run's evidence (diagnosis/evidence.py's LiveEvidence as data, less its prompts, which the report
    holds per prompt): what the log and the server said during the run."""
    version: str | None = None
    engine: str | None = None
    decode_backend: str | None = None
    prefill_backend: str | None = None
    backend_lines: list[str] = _l()
    cudagraph_mode: str | None = None
    eager: bool | None = None
    model_type: str | None = None
    architecture: str | None = None
    index_topk: int | None = None
    tensor_parallel_size: int | None = None
    gpu: str | None = None
    compute_capability: str | None = None
    decode_threshold: int | None = None
    configuration: str | None = None
    settings: dict[str, Any] = _d()
    method: str | None = None
    server_started: bool | None = None
    start_error: str | None = None
    fatal_lines: list[str] = _l()
    restored: bool | None = None
    restore_detail: str | None = None
    extra_: dict[str, Any] = _d()  # the rest of LiveEvidence's fields, as built
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class PatchSection(Section):
    """A patch step (host/patch.py): the run, its targets, the agent's outcome and files, the undo command."""
    run_id: str | None = None
    method: str | None = None
    dry_run: bool | None = None
    targets: list[Any] = _l()
    skipped_optional: list[Any] = _l()
    missing_symbols: list[Any] = _l()
    outcome: str | None = None  # patched | refused | failed | unknown | ...
    run_dir: str | None = None
    records_dir: str | None = None
    lease: dict[str, Any] = _d()
    watchdog_pid: int | None = None
    files: list[Any] = _l()
    undo: str | None = None
    extra_: dict[str, Any] = _d()  # plugin, refused, error, revert as the agent answered them
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class RevertSection(Section):
    """A revert (host/patch.py's revert_host): each run found and what its files became."""
    runs: list[dict[str, Any]] = _l()
    dry_run: bool | None = None
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class TransportSection(Section):
    """The connection's stats (host/target.py): local or ssh, the connections, executions and bytes."""
    kind: str | None = None  # local | ssh
    connections: int | None = None
    executions: int | None = None
    hops: list[Any] = _l()
    bytes_sent: int | None = None
    bytes_received: int | None = None
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False, repr=False)
class TimingsSection(Section):
    """Seconds each part of the host's work took, in the order they were measured (`with_` adds one)."""
    connect_s: float | None = None
    agent_s: float | None = None
    patch_s: float | None = None
    total_s: float | None = None
    extra_: dict[str, Any] = _d()
    keys_: tuple[str, ...] = ()


SECTIONS: dict[str, type[Section]] = {"vllm": VllmSection, "static": StaticSection, "model": ModelSection,
                                      "server": ServerSection, "log": LogSection, "gpu": GpuSection,
                                      "evidence": EvidenceSection, "patch": PatchSection, "revert": RevertSection,
                                      "transport": TransportSection,
                                      "timings": TimingsSection}


# --------------------------------------------------------------------------- the answer (`hosts[].answer`)

@dataclass
class Problem:
    """A fail or warn finding as the answer says it: what is wrong and what to do."""
    severity: str
    code: str
    summary: str
    action: str = ""

    @classmethod
    def from_dict(cls, p: Mapping[str, Any]) -> Problem:
        return cls(p.get("severity", "?"), p.get("code", "?"), p.get("summary", ""), p.get("action") or "")


@dataclass
class RouteLine:
    """One routing answer for `-v`: the route in words, the conditions it read (with their source) and those it
    could not resolve (in words)."""
    label: str
    text: str
    resolved: dict[str, str] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, r: Mapping[str, Any]) -> RouteLine:
        return cls(r.get("label"), r.get("text"), dict(r.get("resolved") or {}), list(r.get("unresolved") or []))


@dataclass(eq=False)
class HostAnswer(Mapping):
    """The answer to the on-call question for one host, computed once where the report is built
    (diagnosis/answer.py) and stored typed in it; the writers render it. Like a section it reads as the JSON it
    serialises to (`a["problems"]` is a list of dicts); `from_dict` reads a saved report's, any key missing."""
    backend: str = ""
    backend_name: str | None = None
    backend_source: str = ""  # log | run | argv | platform
    dispatch: str | None = None
    family_layer: str | None = None  # a model-private family's layer (code_paths), shown instead of the dispatch
    family_backend: str | None = None  # the backend that layer names itself (backend_cls): wins over the platform's
    threshold: str | None = None
    one_token: str = ""
    long_prompt: str = ""
    # the same two answers as sentences for the first screen: which entry runs, why, and whether that is expected
    one_token_words: str = ""
    long_prompt_words: str = ""
    entry_short: str | None = None  # the 1-token prompt's entry symbol (None: not MLA)
    entry_long: str | None = None  # the long prompt's entry symbol
    model_sparse: bool | None = None
    problems: list[Problem] = field(default_factory=list)
    info_count: int = 0
    routes: list[RouteLine] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> HostAnswer | None:
        """A saved report's answer (None stays None); a key it lacks (a report saved before it was) reads as the
        default."""
        if d is None or isinstance(d, cls):
            return d
        names = cls.__dataclass_fields__
        kw = {k: v for k, v in d.items() if k in names and k not in ("problems", "routes")}
        kw["problems"] = [Problem.from_dict(p) for p in d.get("problems") or [] if isinstance(p, Mapping)]
        kw["routes"] = [RouteLine.from_dict(r) for r in d.get("routes") or [] if isinstance(r, Mapping)]
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self}

    # ---- a read-only Mapping: the JSON this answer serialises to
    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        v = getattr(self, key)
        return [dataclasses.asdict(x) for x in v] if key in ("problems", "routes") else v

    def __iter__(self):
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)
