"""The served model's config.json: a directory, a GGUF file (with --hf-config-path), or a Hugging
Face id in the local cache; only the keys that classify it (MLA, sparse DSA) leave the host.

The model's files are the service user's (a Hugging Face cache is symlinks by design), so they are found and
read as the user who reads them anyway -- the server's own user, or whoever controls the path -- in a child
that dropped to that user (privilege.call_as): a link to a root-only file gets that user's EACCES, never root's
bytes. Root reads them only where the path is root's all the way down (privilege.path_owner).
"""
from __future__ import annotations

import glob
import json
import os
import pwd

from ..common import read_text
from ..privilege import call_as, ids_of_uid, path_owner, proc_ids


MAX_CONFIG_BYTES = 4 * 1024 * 1024

CONFIG_KEYS = ("model_type", "architectures", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "num_key_value_heads",
               "num_hidden_layers", "hidden_size", "index_topk", "index_n_heads", "index_head_dim",
               "index_topk_freq", "index_topk_pattern", "num_nextn_predict_layers", "max_position_embeddings",
               "torch_dtype", "compress_ratios", "head_dim", "is_causal")


def _hf_cache_dirs(env, user_home):
    env = env or {}
    dirs = []
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(k):
            dirs.append(env[k])
    if env.get("HF_HOME"):
        dirs.append(os.path.join(env["HF_HOME"], "hub"))
    if user_home:
        dirs.append(os.path.join(user_home, ".cache", "huggingface", "hub"))
    return dirs


def resolve_model_config(model, hf_config_path=None, env=None, user_home=None, cwd=None):
    """Find config.json for a model argument: a directory, a GGUF file, or a Hugging Face id."""
    tried = []
    if hf_config_path:
        p = hf_config_path if os.path.isabs(hf_config_path) or not cwd else os.path.join(cwd, hf_config_path)
        cand = os.path.join(p, "config.json") if os.path.isdir(p) else p
        tried.append(cand)
        if os.path.isfile(cand):
            return cand, "--hf-config-path", tried
    if model:
        p = model if os.path.isabs(model) or not cwd else os.path.join(cwd, model)
        if os.path.isdir(p):
            cand = os.path.join(p, "config.json")
            tried.append(cand)
            if os.path.isfile(cand):
                return cand, "model directory", tried
        elif os.path.isfile(p) and p.endswith(".gguf"):
            tried.append(p)
            sib = os.path.join(os.path.dirname(p), "config.json")
            tried.append(sib)
            if os.path.isfile(sib):
                return sib, "config.json beside the GGUF file", tried
            return None, "GGUF file without --hf-config-path", tried
        elif os.path.isfile(p) and os.path.basename(p) == "config.json":
            return p, "file", tried
        if "/" in model and not model.startswith(("/", ".")):
            repo = "models--" + model.replace("/", "--")
            for hub in _hf_cache_dirs(env, user_home):
                snaps = os.path.join(hub, repo, "snapshots")
                ref = os.path.join(hub, repo, "refs", "main")
                chosen = []
                try:
                    chosen.append(os.path.join(snaps, read_text(ref).strip(), "config.json"))
                except OSError:
                    pass
                chosen += sorted(glob.glob(os.path.join(snaps, "*", "config.json")))
                for c in chosen:
                    tried.append(c)
                    if os.path.isfile(c):
                        return c, "Hugging Face cache", tried
    return None, None, tried


def read_model_config(path):
    data = json.loads(read_text(path, MAX_CONFIG_BYTES))
    picked = {k: data[k] for k in CONFIG_KEYS if k in data}
    text = data.get("text_config")
    if isinstance(text, dict):
        picked["text_config"] = {k: text[k] for k in CONFIG_KEYS if k in text}
    return picked


def model_section(plan, server):
    model = plan.get("model")
    hf_cfg = None
    env = cwd = home = None
    source = "--model" if model else None
    if not model and server:
        model = server.get("model_arg")
        hf_cfg = server.get("hf_config_path")
        env = server.get("_raw_env")
        cwd = server.get("cwd")
        source = "server argv"
        try:
            home = pwd.getpwuid(server["uid"]).pw_dir
        except KeyError:
            home = None
    if not model:
        return None
    if home is None:
        home = os.path.expanduser("~")
    out = {"argument": model, "source": source}
    # the server's user reads what the server reads; a --model argument is read as whoever controls it
    ids, out["read_as"] = _reader(server if source == "server argv" else None, model, hf_cfg, env, home, cwd)
    try:
        out.update(call_as(ids, _find_and_read, (model, hf_cfg, env, home, cwd)))
    except OSError as e:
        out.update(config_path=None, resolved_by=None, tried=[], error="cannot read the model's files: %s" % e)
    return out


def _norm(path):
    return os.path.normpath(path) if isinstance(path, str) and path else None


def own_model(model, server, loc):
    """The model whose architectures narrow this install's resolution: a --model always; the server's argv only
    when that server runs this install (another venv's server never narrows the audit of this one: issue 28)."""
    if not model or model.get("source") != "server argv" or not server or loc.get("source") == "running server":
        return model
    inst = server.get("install") or {}
    mine = {_norm(loc.get("dir")), _norm(loc.get("dir_real"))} - {None}
    theirs = ({_norm(inst.get("vllm_dir")), _norm(inst.get("vllm_dir_real"))}
              | {_norm(d) for d in server.get("mapped_vllm_dirs") or []}) - {None}
    if theirs:
        return model if mine & theirs else None
    if inst.get("prefix") and loc.get("prefix"):
        return model if _norm(inst["prefix"]) == _norm(loc["prefix"]) else None
    return model


def _find_and_read(model, hf_cfg, env, home, cwd):
    """resolve_model_config + read_model_config, as one JSON-able answer (run by call_as as the reader)."""
    path, how, tried = resolve_model_config(model, hf_cfg, env, home, cwd)
    out = {"config_path": path, "resolved_by": how, "tried": tried[:10]}
    if path:
        try:
            out["config"] = read_model_config(path)
        except (OSError, ValueError) as e:
            out["error"] = "cannot read %s: %s" % (path, e)
    else:
        out["error"] = "no config.json found for %s (%s)" % (model, how or "not a directory, GGUF or cached id")
    return out


def _reader(server, model, hf_cfg, env, home, cwd):
    """(ids, uid) who reads the model's files: the server's own user (not root), else the first user who
    controls one of the paths looked at (the model or --hf-config-path argument, the Hugging Face caches);
    None: root, every such path being root's all the way down."""
    if os.geteuid() != 0:
        return None, os.geteuid()
    if server and server.get("uid"):
        try:
            ids = proc_ids(server["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            ids = ids_of_uid(server["uid"])
        if ids[0] != 0:
            return ids, ids[0]
    looked = [p if os.path.isabs(p) or not cwd else os.path.join(cwd, p) for p in (hf_cfg, model) if p]
    looked += _hf_cache_dirs(env, home)
    for p in looked:
        p = os.path.abspath(p)
        while not os.path.lexists(p) and p != "/":  # judge what exists of it (a missing cache: its parent)
            p = os.path.dirname(p)
        try:
            owner = path_owner(p)
        except OSError:
            continue
        if not owner.trusted:
            ids = ids_of_uid(owner.uid)
            return ids, ids[0]
    return None, 0
