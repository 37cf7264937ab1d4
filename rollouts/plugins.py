"""Load user functions by dotted path and check them against their Protocol at start-up.

`load_function("my_pkg.rewards.score", RewardFn)` imports the module once, fetches the attribute,
and checks that it is callable with the parameter names the protocol's `__call__` declares, so a
typo or a wrong signature fails before any rollout is generated, not in the middle of step 40.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import trio


class PluginError(ValueError):
    """A user function that cannot be loaded, or that does not fit its protocol."""


def _required_params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return [p for p in params if p.name != "self"]


def check_signature(fn: Callable[..., Any], protocol: type, name: str = "") -> None:
    """Raise `PluginError` unless `fn` accepts the positional parameters of `protocol.__call__`."""
    label = name or getattr(fn, "__qualname__", repr(fn))
    if not callable(fn):
        raise PluginError(f"{label}: is a {type(fn).__name__}, not a function")
    expected = [p.name for p in _required_params(protocol.__call__)]
    try:
        params = _required_params(fn)
    except (TypeError, ValueError) as e:
        raise PluginError(f"{label}: cannot read its signature: {e}") from e
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    want = f"({', '.join(expected)})"
    if len(required) > len(expected):
        extra = [p.name for p in required[len(expected) :]]
        raise PluginError(
            f"{label}: takes extra required parameter(s) {extra}; "
            f"a {protocol.__name__} is called as {label}{want}"
        )
    if len(positional) < len(expected) and not has_varargs:
        got = f"({', '.join(p.name for p in positional)})"
        raise PluginError(
            f"{label}{got}: takes {len(positional)} parameter(s), "
            f"a {protocol.__name__} is called with {len(expected)}: {label}{want}"
        )


def import_object(dotted: str) -> Any:
    """Import `package.module.attr` (or `package.module:attr`) and return the attribute."""
    if not dotted or not isinstance(dotted, str):
        raise PluginError(f"{dotted!r}: expected a dotted path like 'my_pkg.module.function'")
    module_name, sep, attr = dotted.partition(":")
    if not sep:
        module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{dotted!r}: expected a dotted path like 'my_pkg.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{dotted!r}: cannot import module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise PluginError(
                f"{dotted!r}: module {module_name!r} has no attribute {part!r}; it has: {names}"
            )
        obj = getattr(obj, part)
    return obj


def load_function(dotted_or_fn: str | Callable[..., Any], protocol: type) -> Callable[..., Any]:
    """Resolve a user function (dotted path or the function itself) and check its signature."""
    if callable(dotted_or_fn) and not isinstance(dotted_or_fn, str):
        fn = dotted_or_fn
        name = getattr(fn, "__qualname__", repr(fn))
    else:
        fn = import_object(dotted_or_fn)
        name = str(dotted_or_fn)
    check_signature(fn, protocol, name)
    return fn


def dotted_name(fn: Callable[..., Any]) -> str:
    """The name errors give a user function: module and qualified name (or its type's), looked
    for through wrappers (`__wrapped__`) and `functools.partial` (`func`)."""
    inner: Any = fn
    for _ in range(8):
        inner = getattr(inner, "__wrapped__", None) or getattr(inner, "func", None) or inner
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    module = getattr(inner, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins", "__main__") else name


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """True for `async def` functions and objects whose `__call__` is `async def`."""
    call = type(fn).__call__ if not inspect.isfunction(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


async def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async user function, or run a sync one in a worker thread (never blocks trio)."""
    if is_async_callable(fn):
        return await fn(*args)
    return await trio.to_thread.run_sync(functools.partial(fn, *args))
