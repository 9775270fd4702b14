"""The host layer: one host's work. `target` (who, how: `HostTarget`, `connect`), `steps` (what: one module per
step kind, each with its `run(ctx)`) and `execute(target, steps, progress, cancel) -> HostReport`
(host/executor.py), the one way to run them; `audit`, `patch`, `live` do the steps' work."""
from __future__ import annotations

from typing import Any

__all__ = ["execute"]


def __getattr__(name: str) -> Any:  # lazy: importing host.target must not import every step's module
    if name == "execute":
        from mla_doctor.host.executor import execute

        return execute
    raise AttributeError(name)
