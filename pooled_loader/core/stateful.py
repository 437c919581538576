"""Is an object torchdata's `Stateful`? (``state_dict()`` with no required argument and
``load_state_dict(state)`` with one.)

Datasets of other libraries have methods of those names with other signatures: litdata's
``StreamingDataset.state_dict(num_samples_yielded, num_workers, batch_size)`` and
mosaicml-streaming's ``StreamingDataset.state_dict(num_samples, from_beginning)`` are meant for
their own loaders. Calling them as torchdata does would raise at the first batch, so such an
object counts as stateless (a resume skips ahead over the items consumed), with one warning per
type saying so. The verdict is cached per type: it is asked for on every snapshot.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any

__all__ = ["follows_stateful"]

_VERDICTS: dict[type, bool] = {}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

NOT_STATEFUL_WARNING = (
    "PooledLoader: {name}.{method} takes {why}, so it is not torchdata's Stateful protocol "
    "(state_dict() with no required argument, load_state_dict(state)): the loader treats "
    "{name} as stateless, and a resume from state_dict() skips ahead over the items already "
    "consumed (they are read again, not restored from the dataset's own state).")


def _required(method: Any) -> list[str] | None:
    """Names of the required parameters of a bound method (None: no signature to read)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: trust its name
        return None
    return [p.name for p in params if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _takes_one_argument(method: Any) -> bool:
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return len(_required(method) or []) <= 1
    positional = [p for p in params if p.kind in _POSITIONAL]
    return bool(positional) and len(_required(method) or []) <= 1


def _verdict(obj: Any) -> bool:
    save, load = getattr(obj, "state_dict", None), getattr(obj, "load_state_dict", None)
    if not (callable(save) and callable(load)):
        return False
    required = _required(save)
    why = None
    if required:
        why = "required arguments (" + ", ".join(required) + ")"
        method = "state_dict"
    elif not _takes_one_argument(load):
        why, method = "other than one argument", "load_state_dict"
    if why is None:
        return True
    name = type(obj).__name__
    warnings.warn(NOT_STATEFUL_WARNING.format(name=name, method=method, why=why), UserWarning,
                  stacklevel=4)
    return False


def follows_stateful(obj: Any) -> bool:
    """Whether `obj` has torchdata's `state_dict()`/`load_state_dict(state)` (cached per type;
    warns once per type that has those names with other signatures)."""
    cls = type(obj)
    verdict = _VERDICTS.get(cls)
    if verdict is None:
        verdict = _VERDICTS[cls] = _verdict(obj)
    return verdict
