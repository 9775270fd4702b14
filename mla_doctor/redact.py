"""Secrets never reach an output: the last net under every report, progress line and error message.

The agent redacts argv and environment on the host already; this covers what the controller itself holds
(`run --env HF_TOKEN=...`, runbook `debug` settings, second-pass arguments, error messages that echo them):

- every value word after a secret flag: `--api-key a b` redacts both (newer vLLM takes `nargs='+'`), up to
  the next word that starts with `-`; `--api-key=a` too. Secret flags: `--api-key`, `--key`, and any flag
  with `token`, `secret`, `password`, `passwd` or `credential` in its name (`--hf-token`, `--auth-token`) —
  except `tokens`/`tokenizer` (`--max-num-batched-tokens 8192` and `--tokenizer PATH` are evidence);
- URL userinfo: `https://user:pass@host/` -> `https://<redacted>@host/`;
- environment values whose names look secret (KEY, TOKEN, SECRET, PASSWORD, PASSWD, CREDENTIAL, AUTH, and a
  `_PASS` / `_PWD` suffix — not `PWD`, the working directory): in environment maps (`env`, `settings`, `debug`,
  ... or any UPPER_CASE name) and `NAME=value` words; a NUL-separated environment (`/proc/PID/environ` read
  as text) entry by entry, whatever the case of the names;
- tokens and keys in free text by their shape, wherever they appear: `sk-...` (OpenAI-style), `hf_...`,
  GitHub (`ghp_`, `gho_`, `ghs_`, `ghu_`, `ghr_`, `github_pat_`), Slack (`xox?-`), JWTs (`eyJ....eyJ....sig`),
  AWS access key ids (`AKIA`/`ASIA` + 16), and what follows `Bearer` (16+ characters) or an `Authorization:` header.
"""
from __future__ import annotations

import enum
import re
from typing import Any

REDACTED = "<redacted>"

# a flag that names an environment variable (`--api-key-env NAME`) holds a name, not a secret
_SECRET_FLAG = re.compile(r"(?i)^(?!.*[-_]env:?$)--?(?:.*(?:api[-_]?key|secret|password|passwd|credential).*"
                          r"|(?:.*[-_])?key|.*token(?!s|iz).*)$")
SECRET_ENV = re.compile(r"(?i)(key|token|secret|password|passwd|passphrase|credential|auth|_pass$|^pass$|_pwd$)")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
# NAME=value in free text, NAME upper case (an environment variable), value up to whitespace or a quote
_ENV_WORD = re.compile(r"\b([A-Z_][A-Z0-9_]*)=(\"[^\"\0]*\"|'[^'\0]*'|[^\s'\"\0]*)")
# name=value / name: value / 'name': 'value' in free text, any case, the name ending in a secret word: a Python
# repr or log line (`api_key='...'`, `Namespace(..., api_key='...')`, `X-API-Key: ...`, `password=...`); the
# name must end there, so `max_num_batched_tokens`, `tokenizer`, `prompt_token_ids` are kept (evidence)
_KV_SECRET = re.compile(
    r"(?i)(?<![A-Za-z0-9_])((?:[A-Za-z0-9]+[_-])*(?:api[_-]?key|apikey|secret(?:[_-]?key)?|password|passwd|"
    r"passphrase|credentials?|token|access[_-]?key|private[_-]?key))(?![A-Za-z0-9_])"
    r"([\"']?[ \t]*[:=][ \t]*\[?[ \t]*[\"']?)([^\s\"',\]\)}<]+)")
# secrets recognised by their shape alone (token formats whose prefix says what they are)
_SHAPES = re.compile(
    r"(?<![A-Za-z0-9_-])(?:sk-[A-Za-z0-9_-]{20,}"   # OpenAI-style (sk-..., sk-proj-...)
    r"|hf_[A-Za-z0-9]{20,}"                                          # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"     # GitHub
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"                                 # Slack
    r"|eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"  # a JWT (header.payload.signature)
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z]))")                       # an AWS access key id
_AUTH_SCHEME = re.compile(r"(?i)(\bauthorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token)\s+)?)[^\s\"',;]{6,}"
                          r"|(\bbearer\s+)[A-Za-z0-9._~+/=-]{16,}")
# what every pattern above needs to match at least once, in the lower-cased text (a superset of each): a string
# holding none of these cannot change under redaction, and most of a report's strings (paths, symbols, numbers)
# are such. Searched in text.lower(): a case-insensitive alternation is ~10x slower than this
_MAYBE_SECRET = re.compile(r"key|secret|pass|credential|token|auth|pwd|bearer|://|sk-|hf_|gh[pousr]_|github_pat_"
                           r"|xox[abprs]-|eyj|akia|asia")
# dict keys whose values are environment maps (any key inside is a variable name)
ENV_MAPS = {"env", "environment", "settings", "settings_not_applied", "debug", "debug_env", "extra_env"}


def is_secret_flag(word: str) -> bool:
    return bool(_SECRET_FLAG.match(word.strip("'\"")))


def is_secret_env(name: str) -> bool:
    return bool(SECRET_ENV.search(name))


def _flag(word: str) -> bool:
    return word.strip("'\"").startswith("-")


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """An argument vector with every value of a secret flag replaced (all words up to the next flag)."""
    out: list[str] = []
    hiding = False
    for a in argv:
        if not isinstance(a, str):
            out.append(a)
            hiding = False
            continue
        if hiding and not _flag(a):
            out.append(REDACTED)
            continue
        hiding = False
        bare = a.strip("'\"")
        if bare.startswith("-") and "=" in bare:
            k = bare.partition("=")[0]
            out.append(f"{k}={REDACTED}" if is_secret_flag(k) else redact_text(a))
            hiding = False
            continue
        if bare.startswith("-") and is_secret_flag(bare):
            hiding = True
            out.append(a)
            continue
        out.append(redact_text(a))
    return out


def _env_word(m: re.Match) -> str:
    return f"{m.group(1)}={REDACTED}" if is_secret_env(m.group(1)) and m.group(2) else m.group(0)


def redact_text(text: str) -> str:
    """Free text (a message, a progress line, a command line): URL userinfo, NAME=value, secret flags."""
    if not isinstance(text, str) or not text:
        return text
    if "\0" in text:  # an environment block (/proc/PID/environ): each entry NAME=value, any case of NAME
        return "\0".join(_environ_entry(e) for e in text.split("\0"))
    if _MAYBE_SECRET.search(text.lower()) is None:  # one scan instead of five substitutions and a split
        return text
    text = _SHAPES.sub(REDACTED, text)
    text = _AUTH_SCHEME.sub(lambda m: (m.group(1) or m.group(2)) + REDACTED, text)
    text = _URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    text = _KV_SECRET.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    text = _ENV_WORD.sub(_env_word, text)
    if "-" not in text:
        return text
    parts = re.split(r"(\s+)", text)  # words and the whitespace between them, kept
    hiding = False
    for i in range(0, len(parts), 2):
        w = parts[i]
        if not w:
            continue
        bare = w.strip("'\"`,;()")
        if hiding and not bare.startswith("-"):
            parts[i] = REDACTED
            continue
        hiding = False
        if bare.startswith("-") and "=" in bare:
            k = bare.partition("=")[0]
            if is_secret_flag(k):
                parts[i] = w.replace(bare, f"{k}={REDACTED}")
        elif bare.startswith("-") and is_secret_flag(bare):
            hiding = True
    return "".join(parts)


def _environ_entry(entry: str) -> str:
    name, eq, value = entry.partition("=")
    if eq and value and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name) and is_secret_env(name):
        return f"{name}={REDACTED}"
    return redact_text(entry) if entry else entry


def redact_env(env: dict) -> dict:
    return {k: (REDACTED if isinstance(k, str) and is_secret_env(k) and isinstance(v, str) and v
                else redact_tree(v)) for k, v in env.items()}


def redact_tree(node: Any, _key: str | None = None) -> Any:
    """A copy of a report (dicts, lists, strings) with every secret above replaced by <redacted>."""
    if isinstance(node, dict):
        if _key in ENV_MAPS:
            return redact_env(node)
        out = {}
        for k, v in node.items():
            if isinstance(k, str) and _ENV_NAME.match(k) and is_secret_env(k) and isinstance(v, str) and v:
                out[k] = REDACTED
            else:
                out[k] = redact_tree(v, k if isinstance(k, str) else None)
        return out
    if isinstance(node, (list, tuple)):
        if any(isinstance(v, str) for v in node):
            return [redact_tree(v) if not isinstance(v, str) else v for v in redact_argv(list(node))]
        return [redact_tree(v) for v in node]
    if isinstance(node, str) and not isinstance(node, enum.Enum):
        return redact_text(node)
    return node
