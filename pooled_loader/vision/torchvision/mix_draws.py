"""The draws of batch mixes: torchvision v2's ``MixUp`` and ``CutMix``, a ``RandomChoice`` (v1
or v2) of them, and the ``RandomMixUp``/``RandomCutMix`` classes of torchvision's reference
classification script (``references/classification/transforms.py``, not importable: recognised
by name and shape, see :func:`is_mix`).

:func:`draw_mix` consumes torch's global RNG (and Python's ``random`` for v1's RandomChoice)
call for call as the transform does and returns a :class:`MixDraw`; ``batch_mix.BatchMix``
applies it in place in the slot (tests/test_augment_draws.py compares both with the real
transforms over many seeds, bit for bit).
"""
from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass
from typing import Any, Optional

import torch

# the reference's class names, old and new spellings
REFERENCE_NAMES = frozenset({"RandomMixUp", "RandomMixup", "RandomCutMix", "RandomCutmix"})
_REFERENCE_ATTRS = ("num_classes", "p", "alpha", "inplace")


@dataclass(frozen=True)
class MixDraw:
    """One batch's mix.

    Attributes:
        kind: "mixup", "cutmix" or "none" (the reference's ``p`` coin lost: only one-hot).
        lam: each sample's own weight in the labels (MixUp: in the images too; CutMix: the
            box-adjusted ``1 - box area / image area``; "none": 1.0).
        box: CutMix's (y1, y2, x1, x2): ``batch[..., y1:y2, x1:x2]`` takes the rolled batch's
            pixels; None otherwise.

    The labels are one-hot float32 for a float32 batch either way (v2 ``.float()``, the
    reference ``.to(batch.dtype)``), mixed as ``rolled * (1 - lam) + own * lam``, each
    product rounded to float32, then the sum (the reference writes ``own * lam + rolled *
    (1 - lam)``: the same value, addition commuting); ``rolled`` is ``roll(1, 0)``.
    """
    kind: str
    lam: float
    box: Optional[tuple[int, int, int, int]]


def _v2_classes() -> tuple[type, type, type]:
    from torchvision.transforms import v2
    return v2.MixUp, v2.CutMix, v2.RandomChoice


def _is_reference(t: Any) -> bool:
    """The reference's RandomMixUp/RandomCutMix, by duck typing: the class name, the four
    attributes, and ``forward(batch, target)``.

    The risk: another class with that name and those attributes but other behaviour would be
    reproduced as the reference's (its forward is not run). The name is unusual enough and the
    signature specific enough that this is taken; a user with such a class can rename it.
    """
    if type(t).__name__ not in REFERENCE_NAMES:
        return False
    if not all(hasattr(t, a) for a in _REFERENCE_ATTRS):
        return False
    forward = getattr(type(t), "forward", None)
    if not callable(forward):
        return False
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["self", "batch", "target"]


def _leaf(t: Any) -> Optional[str]:
    """"v2" or "reference" for a recognised MixUp/CutMix, else None."""
    mixup, cutmix, _ = _v2_classes()
    if type(t) in (mixup, cutmix):
        from torchvision.transforms.v2._utils import _find_labels_default_heuristic
        # another labels_getter finds the labels elsewhere than in (batch, target)
        return "v2" if t._labels_getter is _find_labels_default_heuristic else None
    return "reference" if _is_reference(t) else None


def is_mix(t: Any) -> Optional[str]:
    """Whether ``t`` is a recognised batch mix, and whose: "v2" (a v2 ``MixUp``/``CutMix``, or a
    v2 ``RandomChoice`` of recognised mixes), "v1" (a ``torchvision.transforms.RandomChoice`` of
    them), "reference" (the reference script's RandomMixUp/RandomCutMix, see
    :func:`_is_reference`), else None. Exact classes only for torchvision's (a subclass may draw
    differently)."""
    from torchvision import transforms as v1
    _, _, choice_v2 = _v2_classes()
    if type(t) in (choice_v2, v1.RandomChoice):
        if t.transforms and all(_leaf(m) is not None for m in t.transforms):
            return "v2" if type(t) is choice_v2 else "v1"
        return None
    return _leaf(t)


def mix_num_classes(t: Any) -> Optional[int]:
    """The number of classes the mix one-hot encodes to; None when not known (v2 with
    ``num_classes=None``, or a RandomChoice whose members disagree)."""
    members = t.transforms if hasattr(t, "transforms") else [t]
    found = {m.num_classes for m in members}
    return found.pop() if len(found) == 1 else None


def _sample_lam(alpha: float, shape: tuple) -> float:
    """``torch._sample_dirichlet`` of (alpha, alpha) in the op's shape, first component."""
    return float(torch._sample_dirichlet(torch.full(shape, float(alpha)))[..., 0].item())


def draw_mix(t: Any, version: str, batch_shape: tuple, num_classes: Optional[int]) -> MixDraw:
    """The draws of a recognised mix (see :func:`is_mix`) on a batch of ``batch_shape``
    (B, C, H, W).

    Args:
        t: the transform.
        version: what :func:`is_mix` says of it.
        batch_shape: the image batch's shape.
        num_classes: the classes of the one-hot labels (checked against the transform's).

    Returns:
        The :class:`MixDraw` (``batch_mix.BatchMix`` applies it).
    """
    known = mix_num_classes(t)
    if known is not None and num_classes is not None and known != num_classes:
        raise ValueError(f"the mix one-hot encodes {known} classes, not {num_classes}")
    if version in ("v1", "v2") and hasattr(t, "transforms"):
        if version == "v2":
            index = int(torch.multinomial(torch.tensor(t.p), 1))
        else:
            index = random.choices(range(len(t.transforms)), weights=t.p)[0]
        t = t.transforms[index]
        version = _leaf(t) or ""
    height, width = batch_shape[-2], batch_shape[-1]
    cutmix = type(t).__name__ in ("CutMix", "RandomCutMix", "RandomCutmix")
    if version == "v2":
        lam = _sample_lam(t.alpha, (1, 2))  # Beta(alpha, alpha).sample(): a (1, 2) Dirichlet
    elif version == "reference":
        if torch.rand(1).item() >= t.p:  # compared in float64, after .item()
            return MixDraw(kind="none", lam=1.0, box=None)
        lam = _sample_lam(t.alpha, (2,))
    else:
        raise ValueError(f"not a recognised mix: {t!r}")
    if not cutmix:
        return MixDraw(kind="mixup", lam=lam, box=None)
    cx = int(torch.randint(width, (1,)))
    cy = int(torch.randint(height, (1,)))
    r = 0.5 * math.sqrt(1.0 - lam)
    half_w, half_h = int(r * width), int(r * height)
    x1, x2 = max(cx - half_w, 0), min(cx + half_w, width)
    y1, y2 = max(cy - half_h, 0), min(cy + half_h, height)
    lam = float(1.0 - (x2 - x1) * (y2 - y1) / (width * height))
    return MixDraw(kind="cutmix", lam=lam, box=(y1, y2, x1, x2))

