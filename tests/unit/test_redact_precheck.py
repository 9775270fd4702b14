"""Redaction's pre-check (redact._MAYBE_SECRET): a string it passes over is one no pattern could change, so the
fast path answers exactly what running every pattern answers -- on a real report's strings, on the secrets the
other redaction tests use, and on many random strings built from the patterns' own fragments in any case."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from mla_doctor import redact

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "tests" / "fixtures" / "speed" / "static_vllm_0.33.0.json"

# pieces of every pattern's trigger (and near misses), joined at random with separators
FRAGMENTS = ["api", "key", "Key", "KEY", "_key", "apikey", "secret", "SECRET", "pass", "PASS", "password", "passwd",
             "passphrase", "credential", "Credentials", "token", "TOKEN", "tokens", "tokenizer", "auth", "AUTH",
             "Authorization", "authorization:", "bearer", "Bearer ", "pwd", "_PWD", "PWD", "://", "https://",
             "user:pw@", "@", "sk-", "SK-", "hf_", "HF_", "ghp_", "gho_", "ghs_", "github_pat_", "xoxb-", "xoxp-",
             "eyJ", "eyj", "EYJ", "AKIA", "ASIA", "akia", "--", "-", "=", ":", "'", '"', " ", "\t", "(", ")", ",",
             "ABCDEFGHIJKLMNOP", "abcdefghijklmnopqrstuvwxyz0123456789", "0123456789", "_", ".", "/", "vllm",
             "forward_mha", "X", "Z9"]


def _slow(text):
    """redact_text with the pre-check passing everything: every pattern runs."""
    saved = redact._MAYBE_SECRET
    redact._MAYBE_SECRET = re.compile("")
    try:
        return redact.redact_text(text)
    finally:
        redact._MAYBE_SECRET = saved


def _strings(node, out):
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(k)
            _strings(v, out)
    elif isinstance(node, list):
        for v in node:
            _strings(v, out)
    elif isinstance(node, str):
        out.append(node)
    return out


def test_a_real_report_and_known_secrets_redact_as_every_pattern_does():
    strings = _strings(json.loads(REPORT.read_text()), [])
    secrets = ["restart: vllm serve --api-key sk-1 sk-2 --port 1; HF_TOKEN=hf_x VLLM_LOGGING_LEVEL=DEBUG from "
               "https://bob:hunter2@hub.example/x", "DB_PASS=a MYSQL_PWD=b PASS=c PWD=/home/x",
               "Authorization: Bearer abcdefghijklmnop", "Namespace(api_key='s3', model='m')", "X-API-Key: zz",
               "sk-" + "a" * 30, "hf_" + "b" * 30, "ghp_" + "c" * 36, "xoxb-1234567890-abc", "AKIA" + "A" * 16,
               "eyJhbGciOi.eyJzdWIiOi.c2lnbmF0dXJl", "--client-secret s --db-password p", "bearer " + "t" * 20]
    assert len(strings) > 500
    changed = 0
    for s in strings + secrets:
        slow = _slow(s)
        assert redact.redact_text(s) == slow, s
        changed += slow != s
    assert changed >= len(secrets)  # the secrets above are redacted (the check bites on them, not only on paths)


@pytest.mark.parametrize("seed", range(4))
def test_random_strings_of_the_patterns_fragments(seed):
    rnd = random.Random(seed)
    skipped = 0
    for _ in range(5000):
        s = "".join(rnd.choice(FRAGMENTS) for _ in range(rnd.randint(1, 8)))
        assert redact.redact_text(s) == _slow(s), s
        skipped += redact._MAYBE_SECRET.search(s.lower()) is None
    assert skipped > 100  # the fast path was taken too: both sides were compared
