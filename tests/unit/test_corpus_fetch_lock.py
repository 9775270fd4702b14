"""Two processes asking for the same release at once (make test's background prefetch and a corpus test): one
fetches, the other waits on the release's lock and finds it complete. The fetch itself is a fake (pure logic)."""
from __future__ import annotations

import threading
import time

from tests.support import corpus


def test_a_release_in_flight_is_waited_for_never_fetched_twice(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_CACHE", str(tmp_path))
    calls = []

    def fetch(dist, version, dest):
        calls.append(version)
        time.sleep(0.3)  # a download in flight
        (dest / "vllm").mkdir(parents=True)
        (dest / ".complete").write_text("fake\n")
        return dest

    monkeypatch.setattr(corpus, "_fetch", fetch)
    got = []
    threads = [threading.Thread(target=lambda: got.append(corpus.ensure("vllm", "9.9.9"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == ["9.9.9"], calls
    assert len(got) == 3 and all((g / ".complete").exists() for g in got)
