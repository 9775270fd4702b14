"""The one Jinja2 environment for runbooks and templated inventory strings: sandboxed, strict.

Whoever writes an inventory or a runbook may run commands on a host only through an explicit `command`
step, never through a template: `{{ cycler.__init__.__globals__.os.system('id') }}` is a SecurityError
(reported with the file and line by the caller), during `--dry-run` too. Ranges are capped by the sandbox;
`*` and `**` are capped here so a template cannot build a gigabyte string or number.
(`templates/*.j2`, the patch code rendered by host/instrument.py, are the project's own data: not these.)
"""
from __future__ import annotations

import operator
from typing import Any

import jinja2
import jinja2.nativetypes
import jinja2.sandbox

MAX_PRODUCT = 1 << 20  # items/characters a `*` may produce
MAX_EXPONENT = 1024


class _Sandboxed(jinja2.sandbox.SandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise jinja2.sandbox.SecurityError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_PRODUCT:
                    raise jinja2.sandbox.SecurityError(f"a product of {len(seq) * n} items is too large")
            return operator.mul(left, right)
        return super().call_binop(context, op, left, right)


class SandboxedNativeEnvironment(_Sandboxed, jinja2.nativetypes.NativeEnvironment):
    """A lone `{{ expr }}` renders to the expression's native type, as in playbooks."""


def environment(native: bool = True) -> jinja2.Environment:
    cls = SandboxedNativeEnvironment if native else _Sandboxed
    return cls(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def describe(e: Exception) -> str:
    """One line for an error raised while rendering; a sandbox refusal says it is one."""
    if isinstance(e, (jinja2.sandbox.SecurityError, OverflowError)):
        return f"unsafe template refused (sandbox): {e}"
    if isinstance(e, jinja2.UndefinedError):
        return e.message or str(e)
    if isinstance(e, jinja2.TemplateError):
        return str(e)
    return f"{type(e).__name__}: {e}"
