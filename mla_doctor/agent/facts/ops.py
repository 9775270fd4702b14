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
from .logs import log_section
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
    loc = _step(errors, "locate", locate_vllm, plan, servers, errors) or {"dir": None, "tried": []}
    result = {"agent_version": AGENT_VERSION, "op": "static", "host": host, "errors": errors,
              "servers": servers, "locate": loc, "lookalikes": lookalikes, "server_error": server_error}
    server = servers[0] if len(servers) == 1 else None  # several: none is evidence until --pid names one
    if loc.get("dir"):
        vdir = loc["dir"]
        ident = _step(errors, "identity", vllm_identity, vdir) or {}
        result["vllm"] = ident
        record = None
        if ident.get("install_kind") == "wheel":
            record = parse_record(ident["dist_info"])
        result["index"] = _step(errors, "index", index_tree, vdir, plan.get("index") or {})
        thr = plan.get("thresholds") or threshold_files(plan.get("index"))
        if thr.get("files"):  # decode thresholds as the installed backend files state them
            result["thresholds"] = _step(errors, "thresholds", thresholds_section, vdir, thr)
        wanted = symbols_to_search(plan.get("symbols"), plan.get("symbol_needs"), ident.get("version"),
                                   result["index"], (plan.get("index") or {}).get("known"))  # what they leave
        # the harvested modules' sha256, computed by the integrity pass anyway (facts/logs.py); only where a log
        # can be found (logs._log_lines: --log or a server), else nothing is harvested and listing them costs ~4 ms
        digests = {} if (plan.get("log") or server) else None
        result["scan"] = _step(errors, "scan", scan_tree, vdir, record, wanted, digests)
        if result["scan"] is None:
            digests = None  # a partial list: the harvest walks the tree itself
        result["side_code"] = _step(errors, "side_code", side_code, os.path.dirname(vdir))
        if plan.get("targets"):
            result["targets"] = _step(errors, "targets", resolve_targets, vdir, plan["targets"])
    result["model"] = _step(errors, "model", model_section, plan, server)
    result["log"] = _step(errors, "log", log_section, plan, server, loc.get("dir"), digests)
    result["gpu"] = _step(errors, "gpu", gpu_section)
    if loc.get("dir") and isinstance(plan.get("resolve"), dict):  # the attention code that runs, from the files
        # once per release: the controller's stored answer where the scan proved the tree (resolve_hint.py)
        result["resolution"] = _step(errors, "resolution", resolution, loc["dir"], plan["resolve"],
                                     plan["resolve"].get("architectures")
                                     or _architectures(own_model(result.get("model"), server, loc)),
                                     result.get("vllm"), result.get("gpu"),
                                     _text_architectures(own_model(result.get("model"), server, loc)),
                                     record, result.get("scan"))
    for s in servers:
        s.pop("_raw_env", None)
        s.pop("_argv", None)
    result["elapsed_s"] = round(time_now() - t0, 4)
    return result


def op_index(plan):
    """Index a vllm directory given directly (used by tests and by `--local` tooling)."""
    vdir = plan["vllm_dir"]
    ident = vllm_identity(vdir)
    record = parse_record(ident["dist_info"]) if ident.get("install_kind") == "wheel" else None
    return {"agent_version": AGENT_VERSION, "op": "index", "vllm": ident,
            "scan": scan_tree(vdir, record, plan.get("symbols") or []),
            "index": index_tree(vdir, plan.get("index") or {}), "side_code": side_code(os.path.dirname(vdir))}
