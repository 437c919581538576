"""Typed reads of an untrusted state: the one rule every ``load_state_dict`` and merge follows.

A state comes back from a file (JSON, ``torch.save``) that anyone could have edited, so before a
number in it is used to allocate, skip or index anything it is checked for its type (an integer,
never a bool: ``True`` is an ``int`` to Python) and its range: what it can be on this loader
(the dataset's length, the world size, the shard's size). An error is a `StateMismatch` (a
ValueError) that names the dotted key (``_snapshot._main_snapshot._sampler_iter_yielded``,
``rounds[0].consumed.3[1]``), the value, the bound and why, and says what to do.

Used by pooled_loader.resume (the loader's state), elastic and wds_elastic (merged states),
wds_state and global_shuffle (WebDataset's), and the samplers. Imports only ``errors``.
"""
from __future__ import annotations

from typing import Any

from .errors import StateMismatch

__all__ = ["StateChecks", "SEED_RANGE"]

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""Inclusive. What torch's ``manual_seed`` accepts (and numpy's 64-bit seeds): a state's seed
outside it was not written by a sampler or loader."""

FIX = ("load a state saved by state_dict() as it was written (a JSON or torch.save round trip "
       "is fine), or start afresh without loading one")


def _show(value: Any) -> str:
    return f"{value!r:.80}"


class StateChecks:
    """Getters for one state: each reads a (dotted) key and checks it, or raises naming it.

    ``where`` starts every message (``"PooledLoader.load_state_dict: the state"``); ``prefix``
    is put before every key named (``at()`` makes the checks of a part of the state)."""

    def __init__(self, where: str, prefix: str = "", fix: str = FIX) -> None:
        self.where, self.prefix, self.fix = where, prefix, fix

    def at(self, prefix: str) -> "StateChecks":
        """The same checks, naming keys under ``prefix`` (``"rounds[0]."``)."""
        return StateChecks(self.where, self.prefix + prefix, self.fix)

    def corrupt(self, problem: str) -> StateMismatch:
        return StateMismatch(f"{self.where} is corrupt: {problem}; {self.fix}")

    def bad(self, key: str, problem: str) -> StateMismatch:
        """The error for ``key`` (a path under this prefix; "": the prefix itself)."""
        return self.corrupt(f"'{self.name(key)}' {problem}")

    def name(self, key: str) -> str:
        """``key``'s full dotted name."""
        return f"{self.prefix}{key}".rstrip(".")

    # -- reading -----------------------------------------------------------------------------
    def get(self, node: Any, path: str) -> Any:
        """The value at ``path`` (keys separated by dots) under ``node``."""
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise StateMismatch(
                    f"{self.where} is incomplete or corrupt: '{self.name(path)}' is missing; "
                    f"{self.fix}")
            node = node[key]
        return node

    def section(self, node: Any, path: str) -> dict:
        """A dict at ``path``."""
        return self.dict_value(self.get(node, path), path)

    def integer(self, node: Any, path: str, lo: int | None = None, hi: int | None = None,
                why: str = "") -> int:
        """An integer at ``path`` in ``[lo, hi]`` (None: unbounded on that side); ``why``
        explains the upper bound (``" (the sampler's length)"``)."""
        return self.int_value(self.get(node, path), path, lo, hi, why)

    def count(self, node: Any, path: str, most: int | None = None, why: str = "") -> int:
        """A non-negative integer at ``path``, at most ``most`` (when known)."""
        return self.int_value(self.get(node, path), path, 0, most, why)

    def flag(self, node: Any, path: str) -> bool:
        """``true`` or ``false`` at ``path`` (not 0, 1 or null)."""
        return self.flag_value(self.get(node, path), path)

    # -- checking a value already read -------------------------------------------------------
    def int_value(self, value: Any, key: str, lo: int | None = None, hi: int | None = None,
                  why: str = "") -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(key, f"should be an integer, got {_show(value)}")
        if lo is not None and value < lo:
            raise self.bad(key, f"is {value}: it cannot be negative" if lo == 0 else
                           f"is {value}, less than {lo}")
        if hi is not None and value > hi:
            raise self.bad(key, f"is {value}, more than {hi}{why}")
        return value

    def count_value(self, value: Any, key: str, most: int | None = None, why: str = "") -> int:
        return self.int_value(value, key, 0, most, why)

    def flag_value(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.bad(key, f"should be true or false, got {_show(value)}")
        return value

    def dict_value(self, value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            raise self.bad(key, f"should be a dict, got {type(value).__name__}")
        return value

    def list_value(self, value: Any, key: str, most: int | None = None) -> list:
        """A list of at most ``most`` entries."""
        if not isinstance(value, list):
            raise self.bad(key, f"should be a list, got {type(value).__name__}")
        if most is not None and len(value) > most:
            raise self.bad(key, f"has {len(value)} entries, more than {most}")
        return value

    def seed_value(self, value: Any, key: str) -> int:
        """A 64-bit seed (signed or unsigned, as torch's ``manual_seed`` takes)."""
        return self.int_value(value, key, *SEED_RANGE, " (not a 64-bit seed)")
