"""MixUp/CutMix applied in place on the batch in its slot (issue 47).

torchvision's reference recipe (and most code after it) mixes batches in the loader's
``collate_fn``: ``def collate_fn(batch): return mixup_cutmix(*default_collate(batch))``, where
``mixup_cutmix`` is a v2 ``MixUp``/``CutMix`` or a ``RandomChoice`` of them (v1's
``RandomChoice`` of the reference's own ``RandomMixUp``/``RandomCutMix`` without ``--use-v2``).
Run as it is, that collate stacks the batch anew, rolls a copy of it and mixes into a third.

:func:`read_collate` recognises that collate function by its code, never its name: a function
(or a callable object's ``__call__``) of one argument whose whole body is ``return
T(*default_collate(arg))``, ``default_collate`` resolving to torch's; it returns ``T`` (a
closure variable, a global or an attribute of ``self``). When ``T`` is a mix transform
``mix_draws.is_mix`` recognises, the loader then collates into the slot as it does with no
``collate_fn``, each sample's target written as its one-hot row (the fused folder dataset
does it), and :class:`BatchMix` mixes the batch there: the same draws from the same RNG
(after the batch's samples, in the worker, as under DataLoader), the same soft targets, the
same float arithmetic, and the tuple the transform returns.

Imports: numpy, ``wrappers``; torch and torchvision inside functions.
"""
from __future__ import annotations

import types
from typing import Any

import numpy as np

from pooled_loader.vision.torchvision.wrappers import plain_instructions

__all__ = ["read_collate", "BatchMix"]


def _resolve(fn: types.FunctionType, op: str, name: str, self_obj: Any) -> Any:
    """The object an instruction of ``fn`` loads: a closure cell, a global or ``self.name``."""
    if op == "LOAD_DEREF":
        names = fn.__code__.co_freevars
        if name in names and fn.__closure__:
            try:
                return fn.__closure__[names.index(name)].cell_contents
            except ValueError:  # an empty cell
                return None
        return None
    if op == "LOAD_GLOBAL":
        if name in fn.__globals__:
            return fn.__globals__[name]
        builtins = fn.__globals__.get("__builtins__")
        return getattr(builtins, name, None) if not isinstance(builtins, dict) \
            else builtins.get(name)
    if op in ("LOAD_ATTR", "LOAD_METHOD") and self_obj is not None:
        return vars(self_obj).get(name) if hasattr(self_obj, "__dict__") else None
    return None


def read_collate(collate_fn: Any) -> Any:
    """The object ``collate_fn`` applies to ``*default_collate(batch)`` (whether it is a mix is
    ``mix_draws.is_mix``'s to say), or None when ``collate_fn`` is not of that shape."""
    from torch.utils.data import default_collate
    self_obj = None
    fn = collate_fn
    if not isinstance(fn, types.FunctionType):
        call = getattr(type(collate_fn), "__call__", None)
        if not isinstance(call, types.FunctionType) or isinstance(collate_fn, type):
            return None
        fn, self_obj = call, collate_fn
    nargs = 2 if self_obj is not None else 1
    ins = plain_instructions(fn, nargs)
    if ins is None:
        return None
    if self_obj is not None:  # `self.t` is two instructions: LOAD_FAST self, LOAD_ATTR t
        if not ins or ins[0] != ("LOAD_FAST", fn.__code__.co_varnames[0]):
            return None
        ins = ins[1:]
    arg = fn.__code__.co_varnames[nargs - 1]
    if (len(ins) != 6 or ins[1] != ("LOAD_GLOBAL", ins[1][1]) or ins[2] != ("LOAD_FAST", arg)
            or not ins[3][0].startswith("CALL") or ins[4][0] != "CALL_FUNCTION_EX"
            or ins[5][0] != "RETURN_VALUE"):
        return None
    if _resolve(fn, *ins[1], None) is not default_collate:
        return None
    return _resolve(fn, *ins[0], self_obj)


class BatchMix:
    """A recognised mix transform, applied in place on a batch's images and one-hot targets."""

    def __init__(self, transform: Any, version: str, num_classes: int) -> None:
        self.transform = transform
        self.version = version  # mix_draws.is_mix's
        self.num_classes = num_classes
        self._tmp: np.ndarray | None = None  # one sample's worth of float32, reused

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tmp": None}

    def describe(self) -> str:
        return " ".join(repr(self.transform).split())

    def one_hot_into(self, target: Any, row: np.ndarray | None) -> np.ndarray:
        """The sample's class index as its one-hot float32 row (``row`` when given)."""
        index = int(target)
        if not 0 <= index < self.num_classes:
            raise ValueError(f"target {index} is out of range for the mix's num_classes="
                             f"{self.num_classes} (torch's one_hot raises the same)")
        out = row if row is not None else np.empty(self.num_classes, np.float32)
        out.fill(0.0)
        out[index] = 1.0
        return out

    def _scratch(self, n: int) -> np.ndarray:
        if self._tmp is None or self._tmp.size < n:
            self._tmp = np.empty(n, np.float32)
        return self._tmp[:n]

    def apply(self, images: np.ndarray, targets: np.ndarray) -> None:
        """Mix the (B, C, H, W) float32 ``images`` and (B, K) float32 one-hot ``targets`` in
        place, drawing as the transform draws."""
        from pooled_loader.vision.torchvision.mix_draws import draw_mix
        drawn = draw_mix(self.transform, self.version, tuple(images.shape), self.num_classes)
        if drawn.kind == "none":
            return
        if drawn.kind == "mixup":
            self._mix(images, drawn.lam)
        else:
            self._paste(images, drawn.box)
        self._mix(targets, drawn.lam)

    def _mix(self, x: np.ndarray, lam: float) -> None:
        """``x.roll(1, 0).mul_(1 - lam).add_(x.mul_(lam))`` in place: each row is
        ``float32(prev * (1 - lam)) + float32(row * lam)``, rows taken from the last down so
        that the previous row is still the original."""
        keep, take = np.float32(lam), np.float32(1.0 - lam)
        n = x[0].size
        first_prev = self._scratch(2 * n)
        last, tmp = first_prev[:n].reshape(x[0].shape), first_prev[n:].reshape(x[0].shape)
        np.multiply(x[-1], take, out=last)  # what row 0 gets from the last row
        for i in range(len(x) - 1, 0, -1):
            np.multiply(x[i - 1], take, out=tmp)
            np.multiply(x[i], keep, out=x[i])
            np.add(tmp, x[i], out=x[i])
        np.multiply(x[0], keep, out=x[0])
        np.add(last, x[0], out=x[0])

    def _paste(self, x: np.ndarray, box: tuple[int, int, int, int]) -> None:
        """CutMix's box of the previous image (rolled by one) pasted into each image."""
        y1, y2, x1, x2 = box
        if y2 <= y1 or x2 <= x1:
            return
        region = x[-1][:, y1:y2, x1:x2]
        saved = self._scratch(region.size).reshape(region.shape)
        np.copyto(saved, region)
        for i in range(len(x) - 1, 0, -1):
            x[i][:, y1:y2, x1:x2] = x[i - 1][:, y1:y2, x1:x2]
        x[0][:, y1:y2, x1:x2] = saved
