"""Chat templates: compiling a model's Jinja template and rendering it within bounds.

A chat template is a model file's code, run for every request. It runs in the sandbox
transformers renders templates in (same globals: `raise_exception`, `strftime_now`,
`namespace`; same `{% generation %}` tag), with the operations that can build a huge value from
small ones checked against size bounds first and a time limit on rendering. Messages are
normalised as transformers does before rendering. `render_chat_template` is the one entry point.
"""
from __future__ import annotations

import json
import re
import string
import time
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError


def render_chat_template(
    source: str,
    messages: Sequence[dict],
    *,
    tools: list[dict] | None,
    add_generation_prompt: bool,
    context: dict[str, Any],
) -> str:
    """Render `messages` with the template `source`, as transformers does; `context` holds the
    other variables (bos_token, ..., the caller's extra kwargs). A template that does not
    compile, fails, or goes past a bound raises InvalidRequestError."""
    compiled = _compile_template(source)
    try:
        return _render_bounded(compiled, dict(
            messages=_normalize_messages(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        ))
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, OverflowError,
            RecursionError) as e:
        raise InvalidRequestError(f"chat template error: {_one_line(e)}") from e


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# ---------------------------------------------------------------------------------------------
# Chat templates: the Jinja environment transformers renders them in
# ---------------------------------------------------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering just outputs the body, but templates using it must still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    # The sandbox blocks reading underscore attributes; this blocks storing them too.
    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    if (len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0) > _TOJSON_MAX_INDENT:
        raise _TemplateLimitError(f"tojson indent {indent!r:.20} is over {_TOJSON_MAX_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# A chat template is a model file's code, run for every request. Every string or list it builds
# and its output stay under _TEMPLATE_MAX_LEN items, integers under _TEMPLATE_MAX_BITS bits
# (checked before an operation allocates, not after), and rendering stops after _TEMPLATE_SECONDS
# (checked at every loop iteration and call, the only ways a template can run long).
_TEMPLATE_MAX_LEN = 1 << 24
_TEMPLATE_MAX_BITS = 1 << 16
_TEMPLATE_SECONDS = 2.0
_render_deadline: ContextVar[float] = ContextVar("_render_deadline", default=float("inf"))
_TOJSON_MAX_INDENT = 64
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A chat template went past one of the bounds above."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_len(n: int, what: str = "a string") -> None:
    if n > _TEMPLATE_MAX_LEN:
        raise _TemplateLimitError(f"the template would build {what} of length {n} (limit {_TEMPLATE_MAX_LEN})")


def _check_time() -> None:
    if time.monotonic() > _render_deadline.get():
        raise _TemplateLimitError(f"rendering took over {_TEMPLATE_SECONDS:g} s")


def _bounded_iter(iterable: Iterable) -> Iterator:
    for item in iterable:
        _check_time()
        yield item


def _check_width(digits: str | None) -> None:
    if digits == "*":
        raise _TemplateLimitError("'*' widths in % formats are not allowed in chat templates")
    if digits and (len(digits) > 9 or int(digits) > _TEMPLATE_MAX_LEN):
        _check_len(int(digits[:10]), "a formatted field")


def _check_printf(fmt: str) -> None:
    for m in _PRINTF_FIELD.finditer(fmt):
        for digits in m.groups():
            _check_width(digits)


def _check_format(fmt: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise _TemplateLimitError("nested fields in format specs are not allowed in chat templates")
        for digits in re.findall(r"\d+", spec or ""):
            _check_width(digits)


def _replaced_len(s: str, old: str, new: str, count: Any = -1) -> int:
    n = len(s) + 1 if old == "" else s.count(old)
    if _is_int(count) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _joined_len(sep: str, items: list) -> int:
    return len(sep) * max(len(items) - 1, 0) + sum(len(x) for x in items if isinstance(x, str))


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    def visit_For(self, node: jinja2.nodes.For, frame: jinja2.compiler.Frame) -> None:
        # `for x in xs` iterates environment.bounded_iter(xs), which checks the time
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                                      lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        # `a ~ b`: through the environment, to be bounded like `+` (the base class calls a helper)
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers renders templates in, with the operations that can build a
    huge value from small ones (repetition, powers, concatenation, padding, replace, join,
    format widths) checked against the bounds first."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    bounded_iter = staticmethod(_bounded_iter)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            if _sized(left) and _is_int(right) or _sized(right) and _is_int(left):
                seq, n = (left, right) if _sized(left) else (right, left)
                _check_len(len(seq) * n, "a string" if isinstance(seq, str) else "a list")
            elif _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > _TEMPLATE_MAX_BITS:
                raise _TemplateLimitError(f"the template would build an integer over {_TEMPLATE_MAX_BITS} bits")
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > _TEMPLATE_MAX_BITS:
                raise _TemplateLimitError(f"the template would build an integer over {_TEMPLATE_MAX_BITS} bits")
        elif operator == "+" and _sized(left) and _sized(right):
            _check_len(len(left) + len(right), "a string" if isinstance(left, str) else "a list")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left)
        try:
            return super().call_binop(context, operator, left, right)
        except OverflowError:  # float ** int and the like: "(34, 'Numerical result out of range')"
            raise _TemplateLimitError(f"numeric overflow in {operator!r}") from None

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_time()  # macros (which may recurse) and methods
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, str):
            if name in ("center", "ljust", "rjust", "zfill") and args and _is_int(args[0]):
                _check_len(args[0])
            elif name == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                _check_len(len(owner) + owner.count("\t") * (tab if _is_int(tab) else 0))
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check_len(_replaced_len(owner, *args[:3]))
            elif name == "join" and len(args) == 1:
                items = list(args[0])
                _check_len(_joined_len(owner, items))
                args = (items,)
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper

    @staticmethod
    def bounded_concat(values: tuple) -> str:
        parts = [str(v) for v in values]
        _check_len(sum(map(len, parts)))
        return "".join(parts)


# Jinja's filters that can build a huge value from small arguments, checked first.

def _center(value: Any, width: int = 80) -> str:
    if _is_int(width):
        _check_len(width)
    return jinja2.filters.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = str(s)
    pad = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    _check_len(len(text) + (text.count("\n") + 1) * pad)
    return jinja2.filters.do_indent(s, width, first, blank)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    _check_printf(str(value))
    return jinja2.filters.do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def _join(eval_ctx: jinja2.nodes.EvalContext, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)
    _check_len(_joined_len(str(d), items))
    return jinja2.filters.do_join(eval_ctx, items, d, attribute)


@jinja2.pass_eval_context
def _replace(eval_ctx: jinja2.nodes.EvalContext, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    _check_len(_replaced_len(str(s), str(old), str(new), -1 if count is None else count))
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


@jinja2.pass_environment
def _wordwrap(environment: jinja2.Environment, s: Any, width: int = 79, break_long_words: bool = True,
              wrapstring: str | None = None, break_on_hyphens: bool = True) -> str:
    text = str(s)
    lines = len(text) // max(width, 1) + text.count("\n") + 1 if _is_int(width) else len(text)
    _check_len(len(text) + lines * len(wrapstring or environment.newline_sequence))
    return jinja2.filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def _batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    if _is_int(linecount):
        _check_len(linecount, "a batch")
    return jinja2.filters.do_batch(value, linecount, fill_with)


def _slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    if _is_int(slices):
        _check_len(slices, "a list of slices")
    return jinja2.filters.do_slice(value, slices, fill_with)


_BOUNDED_FILTERS = {"center": _center, "indent": _indent, "format": _format, "join": _join, "replace": _replace,
                    "wordwrap": _wordwrap, "batch": _batch, "slice": _slice, "tojson": _tojson}


def _render_bounded(template: jinja2.Template, context: dict[str, Any]) -> str:
    """template.render(context) within the bounds on output size and time."""
    token = _render_deadline.set(time.monotonic() + _TEMPLATE_SECONDS)
    out, size = [], 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > _TEMPLATE_MAX_LEN:
                raise _TemplateLimitError(f"the template's output is over {_TEMPLATE_MAX_LEN} characters")
            _check_time()
            out.append(chunk)
    finally:
        _render_deadline.reset(token)
    return "".join(out)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters.update(_BOUNDED_FILTERS)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except (jinja2.TemplateSyntaxError, RecursionError) as e:
        raise InvalidRequestError(f"chat template does not compile: {_one_line(e)}") from e


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """What transformers does to messages before rendering: drop keys whose value is None (APIs
    send `content: null` with tool calls), and expose reasoning under each name templates read."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
