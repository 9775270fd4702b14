"""Instrumentation: patch targets (playbook data) + Jinja2 templates -> a plan the host's agent applies.

The controller decides *what* (targets for this release, rendered code); the agent on the host
enforces *safety* (hash check, backups, atomic writes, compile, lock, watchdog, revert).
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from mla_doctor import yamlfile
from mla_doctor.diagnosis.knowledge import Knowledge, parse_version
from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.host.patch_options import PatchOptions
from mla_doctor.paths import PLAYBOOKS_DIR, TEMPLATES_DIR
from mla_doctor.remote.protocol import PatchRequest

ROLES = ("prefill", "decode", "sparse", "dispatch", "builder")


@dataclass(frozen=True)
class Target:
    key: str
    role: str
    versions: SpecifierSet
    files: tuple[str, ...]
    function: str
    where: str = "entry"
    optional: bool = False
    line: int | None = None

    def applies(self, version: Version | None) -> bool:
        return version is None or self.versions.contains(version, prereleases=True)


@dataclass(frozen=True)
class TargetSet:
    name: str
    path: str
    template: str
    targets: tuple[Target, ...]

    def agent_request(self) -> list[dict[str, Any]]:
        return [{"key": t.key, "files": list(t.files), "function": t.function} for t in self.targets]


# a parsed playbook per (path, text): a patch plan checks it when it is built and loads it again to run; a
# TargetSet is frozen, so the same one is handed out while the file says the same
_LOADED: dict[tuple[str, str], TargetSet] = {}


def load_targets(name_or_path: str = "instrument-mla") -> TargetSet:
    path = Path(name_or_path)
    if not path.suffix:
        path = PLAYBOOKS_DIR / f"{name_or_path}.yaml"
    text = yamlfile.read_text(str(path))
    key = (str(path), text)
    got = _LOADED.get(key)
    if got is None:
        got = _LOADED[key] = _parse_targets(path, text)
    return got


def _parse_targets(path: Path, text: str) -> TargetSet:
    doc = yamlfile.load(str(path), text)
    p = str(path)
    if not isinstance(doc, dict):
        raise ConfigFileError(p, 1, "a targets playbook is a mapping with a 'targets' list")
    items = yamlfile.require(doc, "targets", list, p, "playbook")
    targets = []
    for i, t in enumerate(items):
        what = f"target #{i + 1}"
        if not isinstance(t, dict):
            raise ConfigFileError(p, yamlfile.line_of(doc), f"{what} must be a mapping")
        line = yamlfile.line_of(t)
        role = yamlfile.require(t, "role", str, p, what)
        if role not in ROLES:
            raise ConfigFileError(p, line, f"{what}: role {role!r} is not one of {', '.join(ROLES)}")
        try:
            spec = SpecifierSet(str(yamlfile.require(t, "versions", str, p, what)))
        except InvalidSpecifier as e:
            raise ConfigFileError(p, line, f"{what}: bad versions specifier: {e}") from e
        files = yamlfile.require(t, "files", list, p, what)
        func = yamlfile.require(t, "function", str, p, what)
        if not (func.startswith("*.") or "." in func or func.isidentifier()):
            raise ConfigFileError(p, line, f"{what}: function must be Class.method or *.method: {func!r}")
        where = str(t.get("where", "entry"))
        if where != "entry" and not (where.startswith("after_assign:") and where.split(":", 1)[1].isidentifier()):
            raise ConfigFileError(p, line, f"{what}: where must be 'entry' or 'after_assign:NAME', not {where!r}")
        targets.append(Target(key=f"{role}-{i + 1}", role=role, versions=spec, files=tuple(files), function=func,
                              where=where, optional=bool(t.get("optional", False)), line=line))
    return TargetSet(name=str(doc.get("name") or path.stem), path=p,
                     template=str(doc.get("template") or "probe_call.py.j2"), targets=tuple(targets))


def family_targets(static_raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The resolution's probe targets (the agent's static answer, `resolution.probe_targets`)."""
    res = static_raw.get("resolution") if isinstance(static_raw, dict) else None
    items = (res or {}).get("probe_targets") if isinstance(res, dict) else None
    return [t for t in items or [] if isinstance(t, dict) and t.get("file") and t.get("class") and t.get("method")]


def never_patch_check(facts, rel: str, function: str) -> str | None:
    """The knowledge's torch.compile-traced list: refuse those (a graph break can stop the server)."""
    for e in getattr(facts, "never_patch", ()) or ():
        if e.def_path == rel and e.symbol == function:
            return e.note or "traced by torch.compile"
    return None


class Templates:
    """Jinja2 in strict mode: an undefined variable is an error, not an empty string."""

    def __init__(self, directory: Path | str | None = None):
        self.dir = Path(directory or TEMPLATES_DIR)
        if not self.dir.is_dir():
            raise UsageError(f"{self.dir}: templates directory not found")
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(self.dir)),
                                      undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                      autoescape=False)

    def render(self, name: str, **ctx: Any) -> str:
        try:
            return self.env.get_template(name).render(**ctx)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigFileError(str(self.dir / name), e.lineno, f"template error: {e.message}") from e
        except jinja2.TemplateError as e:
            raise ConfigFileError(str(self.dir / name), None, f"template error: {e}") from e


@dataclass
class PreparedPatch:
    run_id: str
    request: PatchRequest | None = None  # None until prepare_patch has built it
    missing: list[str] = field(default_factory=list)
    skipped_optional: list[str] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)

    @property
    def plan(self) -> dict[str, Any]:
        """The patch op's plan, as the agent receives it."""
        return self.request.to_plan() if self.request is not None else {}


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def probe_module_name(run_id: str) -> str:
    return "mla_doctor_probe_" + run_id.replace("-", "_").replace(".", "_")


def prepare_patch(kb: Knowledge, tset: TargetSet, static_raw: dict[str, Any], opts: PatchOptions,
                  templates: Templates | None = None) -> PreparedPatch:
    """Pure: from the static audit's answer (with target resolution) to the agent's patch plan."""
    templates = templates or Templates(opts.templates)
    run_id = opts.run_id or new_run_id()
    version_str = (static_raw.get("vllm") or {}).get("version")
    version = parse_version(version_str)
    facts = kb.for_version(version_str)
    vdir = (static_raw.get("locate") or {}).get("dir")
    resolved = {r["key"]: r for r in static_raw.get("targets") or []}
    module = probe_module_name(run_id)
    run_dir = f"{opts.run_root.rstrip('/')}/runs/{run_id}"
    records_dir = f"{run_dir}/records"
    prepared = PreparedPatch(run_id=run_id)
    files: dict[str, dict[str, Any]] = {}
    plugin_targets: dict[str, list] = {}
    for t in tset.targets:
        if not t.applies(version):
            continue
        matches = (resolved.get(t.key) or {}).get("matches") or []
        if not matches:
            label = f"{t.function} in {', '.join(t.files)} ({t.role}, {tset.path}:{t.line})"
            (prepared.skipped_optional if t.optional else prepared.missing).append(label)
            continue
        for m in matches:
            why = never_patch_check(facts, m["rel"], m["function"])
            if why:
                raise ConfigFileError(tset.path, t.line, f"{m['function']} in {m['rel']} is torch.compile-traced "
                                                         f"({why}): refusing to instrument it")
            code = templates.render(tset.template, module=module, target_id=t.key, role=t.role,
                                    function=m["function"], run_id=run_id)
            f = files.setdefault(m["rel"], {"rel": m["rel"], "expected_sha256": m["sha256"], "inserts": []})
            f["inserts"].append({"function": m["function"], "where": t.where, "code": code, "target": t.key})
            prepared.targets.append({"key": t.key, "role": t.role, "file": "vllm/" + m["rel"],
                                     "function": m["function"], "line": m.get("line"), "where": t.where})
            modname = "vllm." + m["rel"][:-3].replace("/", ".")
            # the plugin wraps entries; a mid-function split needs the patch, so the plugin records the
            # dispatch at its entry (its layer, q rows and metadata: what forward_mha then inherits)
            if t.where == "entry" or t.role == "dispatch":
                plugin_targets.setdefault(modname, []).append([m["function"], t.key, t.role])
    # the served family's own entries, as the installed code resolved them (agent/facts/resolve.py): DeepSeek V4's
    # platform forward_mqa, Kimi K3's fused prefill... The shared entries are the playbook's; dispatch-role methods
    # of a family are listed for attach, not patched (the playbook's split probes need their after_assign point).
    placed = {(t["file"], t["function"]) for t in prepared.targets}
    for i, ft in enumerate(family_targets(static_raw), 1):
        rel, function = ft["file"], f"{ft['class']}.{ft['method']}"
        if ("vllm/" + rel, function) in placed or ft.get("role") not in ("prefill", "decode") or not ft.get("sha256"):
            continue
        why = never_patch_check(facts, rel, function)
        if why:
            continue  # traced code is never a target, whoever found it
        key = f"family:{ft.get('family')}:{ft['role']}:{i}"
        code = templates.render(tset.template, module=module, target_id=key, role=ft["role"], function=function,
                                run_id=run_id)
        f = files.setdefault(rel, {"rel": rel, "expected_sha256": ft["sha256"], "inserts": []})
        if f["expected_sha256"] != ft["sha256"]:
            continue  # the playbook resolved another content of this file: never mix two hashes in one plan
        f["inserts"].append({"function": function, "where": "entry", "code": code, "target": key})
        prepared.targets.append({"key": key, "role": ft["role"], "file": "vllm/" + rel, "function": function,
                                 "line": ft.get("line"), "where": "entry", "family": ft.get("family"),
                                 "architecture": ft.get("architecture"), "platform": ft.get("platform"),
                                 "call_site": "vllm/" + str(ft.get("call_site"))})
        placed.add(("vllm/" + rel, function))
        plugin_targets.setdefault("vllm." + rel[:-3].replace("/", "."), []).append([function, key, ft["role"]])
    import_code = templates.render("probe_import.py.j2", module=module, run_id=run_id)
    for f in files.values():
        f["inserts"].insert(0, {"function": None, "where": "module", "code": import_code, "target": "armed"})
    probe_src = templates.render("probe_module.py.j2", run_id=run_id, records_dir=records_dir,
                                 lease_path=f"{run_dir}/lease.json", max_detail=opts.max_detail,
                                 flush_s=opts.flush_s)
    request = PatchRequest(run_id=run_id, run_root=opts.run_root, vllm_dir=vdir, ttl=opts.ttl, dry_run=opts.dry_run,
                           method=opts.method, controller={"pid": os.getpid(), "started": time.time()},
                           probe={"module": module, "source": probe_src})
    if opts.method == "plugin":
        plugin_mod = module.replace("probe", "plugin", 1)  # only the prefix: a run id may say "probe" too
        request.files = []
        request.plugin = {
            "module": plugin_mod,
            "source": templates.render("plugin.py.j2", run_id=run_id, module=module,
                                       targets=plugin_targets),
            "entry_point": f"mla_doctor_{run_id.replace('-', '_')} = {plugin_mod}:register",
        }
    else:
        request.files = list(files.values())
    prepared.request = request
    return prepared
