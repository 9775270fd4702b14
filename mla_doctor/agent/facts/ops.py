"""The read-only ops: `static` (every fact of the host, one failed step never losing the others)
and `index` (a vllm directory given directly). Nothing here changes a file.
"""
from __future__ import annotations

import os
import sys

from ..common import time_now, user_name
from ..protocol import AGENT_VERSION
from .gpu import gpu_section
from .install import locate_vllm, vllm_identity
from .integrity import parse_record, scan_tree, side_code
from .logs import installed_formats, log_section
from .model import model_section, own_model
from .processes import find_servers, identify
from .resolve_hint import resolution
from .symbols import index_tree, symbols_to_search
from .targets import resolve_targets
from .thresholds import threshold_files, thresholds_section


def _step(errors, name, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # one failed step must not lose the others' evidence
        errors.append({"step": name, "error": "%s: %s" % (type(e).__name__, e)})
        return None


def _architectures(model):
    """The served model's `architectures` (config.json, or its text_config), or None: every MLA one."""
    cfg = (model or {}).get("config") or {}
    archs = cfg.get("architectures") or (cfg.get("text_config") or {}).get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else None


def _text_architectures(model):
    """A VL wrapper's language model, where its code leaves the choice to the config (DeepSeek-VL2)."""
    cfg = (model or {}).get("config") or {}
    for key in ("text_config", "language_config"):
        archs = (cfg.get(key) or {}).get("architectures") if isinstance(cfg.get(key), dict) else None
        if isinstance(archs, list):
            return [a for a in archs if isinstance(a, str)] or None
    return None


def op_static(plan):
    t0 = time_now()
    errors = []
    digests = None
    host = {"hostname": os.uname().nodename,  # gethostname(2) is uname(2)'s nodename; socket costs ~3 ms
            "agent_python": list(sys.version_info[:3]),
            "uid": os.getuid(), "user": user_name(os.getuid())}
    candidates = _step(errors, "servers", find_servers) or []
    servers, lookalikes, server_error = identify(plan, candidates)
    server = servers[0] if len(servers) == 1 else None  # several: none is evidence until --pid names one
    gpu = _step(errors, "gpu", gpu_section)
    contained = _contained(plan, server)
    if contained is None:
        part = _install_steps(plan, servers, server, gpu)
    else:  # the install, the model and the interpreter as the container sees them, read as the server's user
        try:
            part = contained[0](server["pid"], _install_steps, (plan, servers, server, gpu), timeout=600.0,
                                ids=contained[1], cap=256 << 20)
        except OSError as e:
            part = {"locate": {"dir": None, "tried": []}, "errors": [
                {"step": "container", "error": "the server's container could not be read: %s" % (e.strerror or e)}]}
    errors += part.pop("errors", [])
    digests = part.pop("digests", None)
    loc = part["locate"]
    result = {"agent_version": AGENT_VERSION, "op": "static", "host": host, "errors": errors,
              "servers": servers, "lookalikes": lookalikes, "server_error": server_error}
    result.update(part)
    log_dir = loc.get("dir") if contained is None else None
    result["log"] = _step(errors, "log", log_section, plan, server, log_dir, digests)
    if contained is not None and loc.get("dir") and (result["log"] or {}).get("found"):
        try:  # the log through the node's /proc, the formats from the container's install
            result["log"]["formats"] = contained[0](server["pid"], installed_formats, (loc["dir"], plan, digests),
                                                    timeout=120.0, ids=contained[1], cap=64 << 20)
        except OSError as e:
            result["log"]["formats_error"] = "OSError: %s" % (e.strerror or e)
    result["gpu"] = gpu
    for s in servers:
        s.pop("_raw_env", None)
        s.pop("_argv", None)
    result["elapsed_s"] = round(time_now() - t0, 4)
    return result


def _contained(plan, server):
    """(in_ns, the server's ids) when the server runs in another mount namespace (a container) and no --python
    names an interpreter of this host, else None."""
    if server is None or plan.get("python"):
        return None
    from ..attach import container
    from ..privilege import proc_ids

    if not container.in_container(server["pid"]):
        return None
    try:
        return container.in_ns, proc_ids(server["pid"])
    except OSError:
        return None


def _install_steps(plan, servers, server, gpu):
    """Everything read from the install and the model: here, or in the server's container (in_ns)."""
    errors = []
    loc = _step(errors, "locate", locate_vllm, plan, servers, errors) or {"dir": None, "tried": []}
    out = {"locate": loc, "errors": errors}
    digests = record = None
    if loc.get("dir"):
        vdir = loc["dir"]
        ident = _step(errors, "identity", vllm_identity, vdir) or {}
        out["vllm"] = ident
        if ident.get("install_kind") == "wheel":
            record = parse_record(ident["dist_info"])
        out["index"] = _step(errors, "index", index_tree, vdir, plan.get("index") or {})
        thr = plan.get("thresholds") or threshold_files(plan.get("index"))
        if thr.get("files"):  # decode thresholds as the installed backend files state them
            out["thresholds"] = _step(errors, "thresholds", thresholds_section, vdir, thr)
        wanted = symbols_to_search(plan.get("symbols"), plan.get("symbol_needs"), ident.get("version"),
                                   out["index"], (plan.get("index") or {}).get("known"))  # what they leave
        # the harvested modules' sha256, computed by the integrity pass anyway (facts/logs.py); only where a log
        # can be found (logs._log_lines: --log or a server), else nothing is harvested and listing them costs ~4 ms
        digests = {} if (plan.get("log") or server) else None
        out["scan"] = _step(errors, "scan", scan_tree, vdir, record, wanted, digests)
        if out["scan"] is None:
            digests = None  # a partial list: the harvest walks the tree itself
        out["side_code"] = _step(errors, "side_code", side_code, os.path.dirname(vdir))
        if plan.get("targets"):
            out["targets"] = _step(errors, "targets", resolve_targets, vdir, plan["targets"])
    out["model"] = _step(errors, "model", model_section, plan, server)
    if loc.get("dir") and isinstance(plan.get("resolve"), dict):  # the attention code that runs, from the files
        # once per release: the controller's stored answer where the scan proved the tree (resolve_hint.py)
        out["resolution"] = _step(errors, "resolution", resolution, loc["dir"], plan["resolve"],
                                  plan["resolve"].get("architectures")
                                  or _architectures(own_model(out.get("model"), server, loc)),
                                  out.get("vllm"), gpu,
                                  _text_architectures(own_model(out.get("model"), server, loc)),
                                  record, out.get("scan"))
    out["digests"] = digests
    return out


def op_index(plan):
    """Index a vllm directory given directly (used by tests and by `--local` tooling)."""
    vdir = plan["vllm_dir"]
    ident = vllm_identity(vdir)
    record = parse_record(ident["dist_info"]) if ident.get("install_kind") == "wheel" else None
    return {"agent_version": AGENT_VERSION, "op": "index", "vllm": ident,
            "scan": scan_tree(vdir, record, plan.get("symbols") or []),
            "index": index_tree(vdir, plan.get("index") or {}), "side_code": side_code(os.path.dirname(vdir))}
