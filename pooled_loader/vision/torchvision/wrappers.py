"""Reading through the small classes training code wraps its ``Compose`` in (issue 47).

torchvision's reference recipes hand the dataset a ``ClassificationPresetTrain`` whose
``__call__`` is ``return self.transforms(img)``, and most training codebases wrap theirs the same
way. :func:`applied_attribute` reads such a wrapper as the attribute it applies, by the wrapper's
code, never by its name: the method (``__call__``, or ``forward`` of an ``nn.Module`` whose call
runs no hooks) must take one argument besides ``self`` and consist of exactly ``return
self.<name>(<that argument>)``. Anything more (a print, a second op, a default argument used,
a conversion of the result) is not read, and :func:`why_not_read` says what stopped it, for the
loader's INFO line. A function, a lambda or a ``functools.partial`` is never read: it runs as it
is.

Imports: the standard library (``dis``, ``types``); torch only where an object is a Module.
"""
from __future__ import annotations

import dis
import sys
import types
from typing import Any

__all__ = ["applied_attribute", "why_not_read", "plain_instructions", "MAX_DEPTH"]

MAX_DEPTH = 4  # wrappers of wrappers read at most this deep (a cycle must end)
# instructions that carry no meaning for the shapes read here (3.11+ bookkeeping)
_NOISE = frozenset({"RESUME", "CACHE", "PRECALL", "PUSH_NULL", "KW_NAMES", "NOP",
                    "COPY_FREE_VARS", "EXTENDED_ARG", "MAKE_CELL"})
# *args, **kwargs, generator, coroutine, async generator and their variants
_NOT_PLAIN = 0x04 | 0x08 | 0x20 | 0x80 | 0x100 | 0x200


def plain_instructions(fn: types.FunctionType, nargs: int) -> list[tuple[str, Any]] | None:
    """``fn``'s instructions as (opname, argval), the interpreter's bookkeeping left out; None
    unless ``fn`` takes exactly ``nargs`` plain positional arguments and is an ordinary function
    (this module's wrappers and ``batch_mix``'s collate functions are read this way)."""
    code = fn.__code__
    if (code.co_argcount != nargs or code.co_kwonlyargcount or code.co_posonlyargcount
            or code.co_flags & _NOT_PLAIN):
        return None
    return [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname not in _NOISE]


def _method(obj: Any) -> tuple[types.FunctionType | None, str]:
    """The Python function that runs when ``obj`` is called, and its name for messages."""
    cls = type(obj)
    torch_nn = sys.modules.get("torch.nn")
    if torch_nn is not None and isinstance(obj, torch_nn.Module):
        if cls.__call__ is not torch_nn.Module.__call__ or _has_hooks(obj, torch_nn):
            return None, f"{cls.__name__}.__call__"
        fn = getattr(cls, "forward", None)
        return (fn if isinstance(fn, types.FunctionType) else None), f"{cls.__name__}.forward"
    fn = getattr(cls, "__call__", None)
    return (fn if isinstance(fn, types.FunctionType) else None), f"{cls.__name__}.__call__"


def _has_hooks(module: Any, torch_nn: Any) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
    if any(getattr(module, h, None) for h in hooks):
        return True
    glob = torch_nn.modules.module
    return any(getattr(glob, f"_global{h}", None) for h in hooks)


def _applied_name(fn: types.FunctionType) -> str | None:
    """``name`` when ``fn``'s code is exactly ``return self.name(arg)``, else None."""
    ops = plain_instructions(fn, 2)
    if ops is None:
        return None
    self_name, arg_name = fn.__code__.co_varnames[:2]
    if len(ops) != 5 or ops[0] != ("LOAD_FAST", self_name) or ops[2] != ("LOAD_FAST", arg_name):
        return None
    if ops[1][0] not in ("LOAD_ATTR", "LOAD_METHOD") or not ops[3][0].startswith("CALL"):
        return None
    if ops[4][0] != "RETURN_VALUE":
        return None
    return ops[1][1]


def applied_attribute(obj: Any) -> Any | None:
    """The attribute ``obj``'s call only applies (see the module docstring), or None."""
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        return None
    fn, _ = _method(obj)
    name = None if fn is None else _applied_name(fn)
    if name is None:
        return None
    try:
        inner = vars(obj)[name]  # an instance attribute (not a method or a property's result)
    except (KeyError, TypeError):
        modules = getattr(obj, "_modules", None)  # an nn.Module's submodule
        inner = modules.get(name) if isinstance(modules, dict) else None
    return inner if callable(inner) else None


def why_not_read(obj: Any) -> str:
    """Why ``obj`` (a transform :func:`applied_attribute` does not read) is not read."""
    if isinstance(obj, types.FunctionType):
        what = "a lambda" if obj.__name__ == "<lambda>" else f"the function {obj.__name__}"
        return f"the transform is {what}, not a torchvision Compose"
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodType)) or \
            type(obj).__name__ == "partial":
        return f"the transform {obj!r} is not a torchvision Compose"
    fn, where = _method(obj)
    if fn is None:
        return f"{where} is not Python code this loader can read"
    attrs = [name for name, value in vars(obj).items() if callable(value)] \
        if hasattr(obj, "__dict__") else []
    applied = _applied_name(fn)
    if applied is not None:
        return f"{where} applies self.{applied}, which is not a transform this loader reads"
    named = f"self.{attrs[0]}" if len(attrs) == 1 else "one of its attributes"
    return f"{where} does more than apply {named}"
