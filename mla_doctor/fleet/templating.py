"""The one Jinja2 environment for runbooks and templated inventory strings: sandboxed, strict, bounded.

Whoever writes an inventory or a runbook may run commands on a host only through an explicit `command`
step, never through a template: `{{ cycler.__init__.__globals__.os.system('id') }}` is a SecurityError
(reported with the file and line by the caller), during `--dry-run` too.

A template also cannot make the controller spend a gigabyte or an hour (a runbook may come from someone else):
- nesting, when it is parsed (a file:line error at load): `for` loops at most MAX_LOOP_DEPTH deep, no
  `recursive` loops, no macros or call blocks (they recurse);
- work, when it renders: at most MAX_ITERATIONS loop bodies per rendering (ranges are capped by the sandbox);
- size: no value (string, list, mapping) longer than MAX_VALUE, no integer wider than MAX_INT_BITS, no
  output longer than MAX_OUTPUT. Every operator (`+ - * / // % **`, `~`), call and filter is checked *before*
  it runs where its size can be foreseen (a product, a power, a padding width, `replace`, `join`, a format
  width) and its result after.
(`templates/*.j2`, the patch code rendered by host/instrument.py, are the project's own data: not these.)
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.nativetypes
import jinja2.nodes as nodes
import jinja2.sandbox

MAX_VALUE = 1 << 20  # characters/items of any one value a template builds
MAX_OUTPUT = 1 << 20  # characters one rendering may produce
MAX_INT_BITS = 1 << 14  # ~4900 decimal digits
MAX_LOOP_DEPTH = 2
MAX_ITERATIONS = 100_000
MAX_PRODUCT = MAX_VALUE  # kept for callers: items/characters a `*` may produce
MAX_EXPONENT = 1024
_WIDE_FORMAT = re.compile(r"\d{7,}|%[-#0 +]*\*|\.\*")  # a width/precision of a million or more, or one from an arg

Refused = jinja2.sandbox.SecurityError


def _size(v: Any) -> None:
    """A value a template made: refused when too big."""
    if isinstance(v, (str, list, tuple, dict, set, frozenset)) and len(v) > MAX_VALUE:
        raise Refused(f"a value of {len(v)} items/characters is too large (at most {MAX_VALUE})")
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > MAX_INT_BITS:
        raise Refused(f"a number of {v.bit_length()} bits is too large (at most {MAX_INT_BITS})")


def _bits(v: Any) -> int:
    return v.bit_length() if isinstance(v, int) and not isinstance(v, bool) else 0


def _args(args: tuple, kwargs: dict) -> None:
    """Call arguments: no padding or width of a million or more (`'a'.ljust(10**9)`, `center(10**9)`)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and a > MAX_VALUE:
            raise Refused(f"an argument of {a} is too large (at most {MAX_VALUE})")


def _format(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise Refused("a format width or precision of a million or more (or taken from an argument) is refused")


def _replace(s: Any, args: tuple) -> None:
    """`s.replace(old, new[, count])` foreseen: the occurrences times the new text's length."""
    if isinstance(s, str) and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = s.count(args[0]) if args[0] else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        if len(s) + count * len(args[1]) > MAX_VALUE:
            raise Refused(f"a replace making more than {MAX_VALUE} characters is too large")


def _join(sep: Any, seq: Any) -> Any:
    """`sep.join(seq)` foreseen: returns the items (a list), refused when the result would be too large."""
    items = list(seq) if not isinstance(seq, (list, tuple)) else seq
    if len(items) > MAX_VALUE:
        raise Refused(f"joining {len(items)} items is too large")
    total = len(sep) * max(len(items) - 1, 0) if isinstance(sep, str) else 0
    total += sum(len(x) if isinstance(x, str) else 32 for x in items)
    if total > MAX_VALUE:
        raise Refused(f"a join making more than {MAX_VALUE} characters is too large")
    return items


class _Budget(threading.local):
    iterations = 0


_BUDGET = _Budget()


def bounded_iter(iterable: Any):
    """A `for` loop's iterable, counted against the rendering's MAX_ITERATIONS."""
    for item in iterable:
        _BUDGET.iterations += 1
        if _BUDGET.iterations > MAX_ITERATIONS:
            raise Refused(f"more than {MAX_ITERATIONS} loop iterations in one template")
        yield item


def bounded_join(parts: tuple) -> str:
    """The `~` operator: the parts' lengths summed before they are joined."""
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    if sum(map(len, strs)) > MAX_VALUE:
        raise Refused(f"a `~` concatenation of more than {MAX_VALUE} characters is too large")
    return "".join(strs)


def _counted(values, inner):
    """What a rendering yields, cut off past MAX_OUTPUT characters (the loop budget starts afresh)."""
    _BUDGET.iterations = 0

    def gen():
        total = 0
        for v in values:
            total += len(v) if isinstance(v, str) else 1
            if total > MAX_OUTPUT:
                raise Refused(f"a template's output of more than {MAX_OUTPUT} characters is too large")
            yield v

    return inner(gen())


class _BoundedCodeGen(jinja2.compiler.CodeGenerator):
    """`~` through bounded_join, every `for` iterable through bounded_iter."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame) -> None:
        wrapped = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                             lineno=node.lineno)
        node = nodes.For(node.target, wrapped, node.body, node.else_, node.test, node.recursive, lineno=node.lineno)
        super().visit_For(node, frame)


class _NativeBoundedCodeGen(_BoundedCodeGen, jinja2.nativetypes.NativeCodeGenerator):
    pass


def _check_tree(tree: nodes.Template) -> None:
    """Nesting, refused when parsed: a TemplateSyntaxError, so the caller names the file and line."""
    for bad in (nodes.Macro, nodes.CallBlock):
        for n in tree.find_all(bad):
            raise jinja2.TemplateSyntaxError(f"template refused (sandbox bounds): {bad.__name__.lower()} blocks are "
                                             "not allowed in runbooks (they recurse without bound)", n.lineno)

    def walk(node: nodes.Node, depth: int) -> None:
        for child in node.iter_child_nodes():
            d = depth
            if isinstance(child, nodes.For):
                if child.recursive:
                    raise jinja2.TemplateSyntaxError("template refused (sandbox bounds): recursive loops are not "
                                                     "allowed", child.lineno)
                d += 1
                if d > MAX_LOOP_DEPTH:
                    raise jinja2.TemplateSyntaxError(f"template refused (sandbox bounds): loops nested deeper "
                                                     f"than {MAX_LOOP_DEPTH}", child.lineno)
            walk(child, d)

    walk(tree, 0)


_PASSED = (jinja2.runtime.Context, jinja2.Environment, nodes.EvalContext)


def _bounded_filter(name: str, f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _args(args, kwargs)
        # the value is the first argument after what pass_context/pass_environment put before it
        i = next((k for k, a in enumerate(args) if not isinstance(a, _PASSED)), None)
        if i is not None:
            value, rest = args[i], args[i + 1:]
            if name == "replace":
                _replace(str(value), rest)
            elif name == "format":
                _format(value)
            elif name == "join":
                items = _join(rest[0] if rest else kwargs.get("d", ""), value)
                args = args[:i] + (items,) + rest  # a generator is consumed once, by the check
        out = f(*args, **kwargs)
        _size(out)
        return out

    return wrapper


class _Sandboxed(jinja2.sandbox.SandboxedEnvironment):
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    code_generator_class = _BoundedCodeGen
    bounded_iter = staticmethod(bounded_iter)
    bounded_join = staticmethod(bounded_join)
    concat = staticmethod(functools.partial(_counted, inner="".join))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {k: _bounded_filter(k, f) for k, f in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        _check_tree(tree)
        return tree

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**":
            if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                raise Refused(f"exponent {right} is too large (at most {MAX_EXPONENT})")
            if isinstance(right, int) and right > 0 and abs(_bits(left) - 1) * right > MAX_INT_BITS:
                raise Refused(f"a power of about {_bits(left) * right} bits is too large (at most {MAX_INT_BITS})")
        elif op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_PRODUCT:
                    raise Refused(f"a product of {len(seq) * n} items is too large")
            if _bits(left) + _bits(right) > MAX_INT_BITS:
                raise Refused(f"a product of {_bits(left) + _bits(right)} bits is too large (at most {MAX_INT_BITS})")
        elif op == "+":
            if (isinstance(left, (str, list, tuple)) and isinstance(right, type(left))
                    and len(left) + len(right) > MAX_VALUE):
                raise Refused(f"a sum of {len(left) + len(right)} items/characters is too large")
        elif op == "%" and isinstance(left, str):
            _format(left)
        out = super().call_binop(context, op, left, right)
        _size(out)
        return out

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805, B902
        _args(args, kwargs)
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name == "replace":
                _replace(owner, args)
            elif name in ("format", "format_map"):
                _format(owner)
            elif name == "join" and args:
                args = (_join(owner, args[0]),) + args[1:]
        out = super().call(__context, __obj, *args, **kwargs)
        _size(out)
        if isinstance(owner, (list, dict, set)):  # `l.extend(big)` in a loop: the list itself stays bounded
            _size(owner)
        return out


class SandboxedNativeEnvironment(_Sandboxed, jinja2.nativetypes.NativeEnvironment):
    """A lone `{{ expr }}` renders to the expression's native type, as in playbooks."""

    code_generator_class = _NativeBoundedCodeGen
    concat = staticmethod(functools.partial(_counted, inner=jinja2.nativetypes.native_concat))


class _NativeTemplate(jinja2.nativetypes.NativeTemplate):
    """NativeTemplate.render concatenates with its `environment_class.concat`: ours, bounded."""

    environment_class = SandboxedNativeEnvironment


SandboxedNativeEnvironment.template_class = _NativeTemplate


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
