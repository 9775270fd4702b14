"""Routes and conditions in words, as an engineer reads them (base layer: imports nothing of mla_doctor).

A route (routing.Route.to_dict(): its branches, each with the entry that runs and the conditions it runs under)
is said as "forward_mha on NVIDIA SM100 with an unquantized KV cache and FA4; otherwise forward_mqa": the
conditions in words, never source-code names ("the nvidia branch of the family's __init__"); where the platform is
a condition (no GPU seen) each platform gets its own clause, so that no platform's entry reads as the host's."""
from __future__ import annotations

from typing import Any

PLATFORMS = {"nvidia": "NVIDIA", "cuda": "NVIDIA", "amd": "AMD", "rocm": "AMD", "xpu": "Intel XPU", "cpu": "CPU"}


def platform_name(key: Any) -> str:
    """`nvidia` -> NVIDIA, `xpu+cpu` -> Intel XPU or CPU (a family's branch shared by several platforms)."""
    parts = [PLATFORMS.get(p, p) for p in str(key).split("+")]
    return " or ".join(parts)


def _values(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _one(var: str, value: Any) -> str:
    if var == "sm":
        return "SM%s" % value if value != 80 else "another GPU (not SM90/100/120)"
    if var == "kv":
        return "an unquantized KV cache" if value == "auto" else "an fp8 KV cache"
    if var == "fa_version":
        return "FA4" if value == 4 else "FlashAttention older than 4"
    if var == "tp":
        return "TP %s" % value
    if var == "local_heads":
        return "%s local heads" % value
    if var == "topk":
        return "a prompt no longer than index_topk" if value == "le" else "a prompt longer than index_topk"
    if var == "dims":
        return "the masked-MHA model dims" if value == "masked" else "other model dims"
    if var == "backend_threshold":
        return "a backend whose decode threshold is %s" % value
    if var == "sinks":
        return "attention sinks" if value else "no attention sinks"
    if var == "engine":
        return "the %s engine" % value
    if var == "platform":
        return platform_name(value)
    return "%s %s" % (var, value)


def condition(var: str, value: Any) -> str:
    """One condition in words; several values of one fact read as alternatives (`SM100 or SM90`)."""
    return " or ".join(_one(var, v) for v in _values(value))


def conditions(conds: dict, vendor: bool = True) -> str:
    """`on NVIDIA SM100 with an unquantized KV cache and FA4`: the GPU first, the rest after `with` (`vendor`
    False: the platform was already said, `on SM100 …`)."""
    conds = dict(conds)
    where = []
    plat = conds.pop("platform", None)
    sm = conds.pop("sm", None)
    if plat is not None:
        where.append(condition("platform", plat))
    if sm is not None:
        where.append(("NVIDIA " if plat is None and vendor else "") + condition("sm", sm))
    rest = [condition(k, v) for k, v in conds.items()]
    out = ("on " + " ".join(where)) if where else ""
    if rest:
        out += (" with " if out else "with ") + " and ".join(rest)
    return out


def _clauses(branches: list[dict], vendor: bool = True) -> str:
    """Within one platform: each entry with its conditions, the decode entry (else the commonest) as otherwise."""
    by: dict[str, list[dict]] = {}
    for b in branches:
        by.setdefault(b.get("symbol") or "?", []).append(b)
    if len(by) == 1:
        return next(iter(by))
    rest = max(by, key=lambda s: (s.endswith("forward_mqa") or s.endswith("_forward_decode"), len(by[s])))
    # the branches of one entry joined by "; or " (a fact's own alternatives say "or": `SM100 or SM90`), so
    # which "or" separates what stays readable
    parts = [("%s %s" % (s, "; or ".join(conditions(b.get("conditions") or {}, vendor) for b in bs))).rstrip()
             for s, bs in by.items() if s != rest]
    return "; ".join(parts) + ("; otherwise " if any("; or " in x for x in parts) else ", otherwise ") + rest


def route(r: dict) -> str:
    """A route in words: the one entry, or each entry with its conditions, per platform where the platform is
    one of them (no GPU seen: each platform said, none claimed as the host's)."""
    branches = [b for b in r.get("branches") or [] if isinstance(b, dict)]
    if r.get("symbol") or len({b.get("symbol") for b in branches}) <= 1:
        return r.get("symbol") or (branches[0].get("symbol") if branches else "?") or "?"
    plats: dict[str, list[dict]] = {}
    for b in branches:
        conds = dict(b.get("conditions") or {})
        plat = conds.pop("platform", None)
        for p in _values(plat) if plat is not None else (None,):
            plats.setdefault(p, []).append(dict(b, conditions=conds))
    if list(plats) == [None]:
        return _clauses(branches)
    return "per platform (the host's is not known): " + "; ".join(
        "on %s, %s" % (platform_name(p) if p is not None else "any other platform", _clauses(bs, False))
        for p, bs in plats.items())


def tokens(n: Any) -> str:
    """`1 token`, `4 tokens`, `1–512 tokens (by backend)` (a range with its note after the unit)."""
    num, _, note = str(n).partition(" (")
    return "%s token%s" % (num, "" if num == "1" else "s") + (" (" + note if note else "")


def prompt_answer(r: dict, threshold: Any = None, backend: str | None = None, engine: str | None = None,
                  full_graph: str | None = None) -> str:
    """What one fresh prompt does, as a sentence (`explain`'s first lines): the entry, why (the threshold as a
    number), whether that is expected; a CUDA graph that hides the decode entry's Python said so."""
    n = r.get("tokens")
    sym = r.get("symbol")
    short = (sym or "").rsplit(".", 1)[-1]
    whose = ("%s's threshold" % backend) if backend else "the threshold"
    thr = ("%s of %s" % (whose, tokens(threshold))) if isinstance(threshold, int) else None
    dense = engine != "V0" and r.get("path") in ("mqa", "mha") and thr is not None
    if dense and r.get("path") == "mqa" and isinstance(n, int) and n <= threshold:
        out = ("a %s-token prompt is decode-only (at or below %s), so it runs %s and forward_mha is never reached; "
               "this is expected, not a fault (a print in forward_mha never fires for it)" % (n, thr, short))
    elif dense and r.get("path") == "mha":
        out = ("a %s prompt is over %s, so its prefill runs %s, then forward_mqa for each output token"
               % ("%s-token" % n, thr, short))
    else:
        out = "a %s prompt runs %s" % ("%s-token" % n, route(r))
    if full_graph and (sym is None or short.endswith(("forward_mqa", "_forward_decode"))):
        out += ("; its decode steps replay a full CUDA graph (%s), so the decode entry's Python (a print) runs only "
                "at capture" % full_graph)
    return out
