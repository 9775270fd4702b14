"""One host's cancel: set from another thread (a host timeout, Ctrl-C), checked with `is_set()` between steps,
and closing the host's connection at once so that a blocked remote call returns (see `attach`)."""
from __future__ import annotations

import threading
from typing import Any


class Cancel:
    """Lets a runner stop a host's work from outside: `fire()` marks it cancelled and closes the attached
    connection (any object with close(), the host's transport), which unblocks its job."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.cancelled = False
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        return self.cancelled

    def attach(self, transport: Any) -> None:
        with self._lock:
            self.transport = transport
            if self.cancelled:
                transport.close()

    def fire(self) -> None:
        with self._lock:
            self.cancelled = True
            if self.transport is not None:
                try:
                    self.transport.close()
                except Exception:  # noqa: BLE001 - best effort from another thread
                    pass
