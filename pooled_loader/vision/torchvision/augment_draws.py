"""The random draws of torchvision's AutoAugment family (TrivialAugmentWide, RandAugment,
AutoAugment, AugMix) and RandomErasing, v1 and v2, and of timm's RandAugment and RandomErasing.

Each ``draw_*`` function consumes the RNGs the op consumes (torch's global RNG; for timm also
Python's ``random`` and numpy's global RNG), call for call in the op's order, and returns the
op's parameters as plain Python values, so a fused kernel applies the same ops with the same
magnitudes as the op would have, sample for sample, and the draws after it stay aligned.
tests/test_augment_draws.py checks every function against the real op over many seeds, values
and RNG states both.

Where the op makes a tensor with one call (``torch.rand(2)``, ``normal_`` on a patch) the same
call is made here: torch's CPU kernels consume the generator differently by size (a vectorised
path from 16 elements), so only the same call on the same shape is the same draw.
"""
from __future__ import annotations

import functools
import math
import random
from typing import Any, Optional, Union

import numpy as np
import torch

from pooled_loader.vision.torchvision.plan import Draws

Ops = list[tuple[str, float]]

# ---------------------------------------------------------------- magnitude tables

# A magnitude rule: ("lin", start, end) is torch.linspace(start, end, bins) (float32);
# ("post", top, quarters) is torchvision's posterize bits 8/4 - round(arange(bins) / ((bins-1)/q));
# None: the op takes no magnitude (0.0, no sign coin).
_Rule = Optional[tuple]


def _space(family: str, version: str, h: int, w: int, all_ops: bool = True
           ) -> dict[str, tuple[_Rule, bool]]:
    """name -> (magnitude rule, signed), in the op's own key order (the order its index draws
    pick from). ``family``: "ta_wide", "ra", "aa" or "augmix"."""
    solar = ("lin", 255.0, 0.0) if version == "v1" else ("lin", 1.0, 0.0)  # v2: a fraction
    if family == "ta_wide":
        geo, shear, translate = 135.0, 0.99, (32.0, 32.0)
        enhance, posterize = 0.99, ("post", 8, 6)
    elif family in ("ra", "aa"):
        geo, shear, translate = 30.0, 0.3, (150.0 / 331.0 * w, 150.0 / 331.0 * h)
        enhance, posterize = 0.9, ("post", 8, 4)
    else:  # augmix
        geo, shear, translate = 30.0, 0.3, (w / 3.0, h / 3.0)
        enhance, posterize = 0.9, ("post", 4, 4)
    space: dict[str, tuple[_Rule, bool]] = {}
    if family in ("ta_wide", "ra"):
        space["Identity"] = (None, False)
    space.update({
        "ShearX": (("lin", 0.0, shear), True), "ShearY": (("lin", 0.0, shear), True),
        "TranslateX": (("lin", 0.0, translate[0]), True),
        "TranslateY": (("lin", 0.0, translate[1]), True),
        "Rotate": (("lin", 0.0, geo), True)})
    enhancers = {name: (("lin", 0.0, enhance), True)
                 for name in ("Brightness", "Color", "Contrast", "Sharpness")}
    tail = {"Posterize": (posterize, False), "Solarize": (solar, False),
            "AutoContrast": (None, False), "Equalize": (None, False)}
    if family == "augmix":  # the enhancers come last, and only with all_ops
        space.update(tail)
        if all_ops:
            space.update(enhancers)
        return space
    space.update(enhancers)
    space.update(tail)
    if family == "aa":
        space["Invert"] = (None, False)
    return space


@functools.lru_cache(maxsize=256)
def _magnitudes(rule: tuple, bins: int, version: str) -> tuple[float, ...]:
    """The op's magnitude tensor for ``rule`` as Python floats (each ``float(t[i])``)."""
    if rule[0] == "lin":
        return tuple(torch.linspace(rule[1], rule[2], bins).tolist())
    _, top, quarters = rule
    steps = torch.arange(bins) / ((bins - 1) / quarters)
    # v1 rounds then subtracts, v2 subtracts then rounds (the same for an even top)
    bits = top - steps.round().int() if version == "v1" else (top - steps).round().int()
    return tuple(float(b) for b in bits.tolist())


def _magnitude(rule: _Rule, bins: int, index: int, version: str) -> float:
    return _magnitudes(rule, bins, version)[index]


def _f32(x: float) -> float:
    """``x`` rounded to float32: torch compares a float32 tensor with a Python float in
    float32."""
    return float(np.float32(x))


# ---------------------------------------------------------------- AutoAugment family

def _family(op: Any) -> str:
    name = type(op).__name__
    families = {"TrivialAugmentWide": "ta_wide", "RandAugment": "ra", "AutoAugment": "aa",
                "AugMix": "augmix"}
    if name not in families:
        raise TypeError(f"not an AutoAugment-family op: {name}")
    return families[name]


def draw_auto_augment(op: Any, version: str, h: int, w: int, draws: Draws) -> Ops:
    """The (op name, signed magnitude) pairs that torchvision's ``TrivialAugmentWide``,
    ``RandAugment`` or ``AutoAugment`` applies to an h x w image, in order, drawn as its forward
    draws them.

    Args:
        op: the torchvision transform (v1 ``torchvision.transforms`` or v2).
        version: "v1" or "v2" (the module the op comes from).
        h, w: the image's height and width (TranslateX/Y magnitudes of RandAugment and
            AutoAugment scale with them).
        draws: the process's reused one-element tensors.

    Returns:
        What the op passes to ``_apply_op`` (v1) / ``_apply_image_or_video_transform`` (v2):
        "Identity" included when drawn, AutoAugment's sub-policy ops that lose their
        probability coin left out. v2's Solarize magnitude is a fraction of the dtype's maximum
        (the op multiplies it by 255 for uint8 and PIL), v1's is the threshold itself.
    """
    family = _family(op)
    if family == "augmix":
        raise TypeError("AugMix: use draw_augmix")
    space = _space(family, version, h, w)
    names = list(space)
    if family == "aa":
        return _draw_aa(op, version, space, draws)
    out: Ops = []
    for _ in range(op.num_ops if family == "ra" else 1):
        name = names[draws.randint(0, len(names))]
        rule, signed = space[name]
        if rule is None:
            out.append((name, 0.0))
            continue
        bins = op.num_magnitude_bins
        index = op.magnitude if family == "ra" else draws.randint(0, bins)
        magnitude = _magnitude(rule, bins, index, version)
        if signed and _sign_coin(version, draws):
            magnitude *= -1.0
        out.append((name, magnitude))
    return out


def _sign_coin(version: str, draws: Draws) -> bool:
    """True to negate: v1 ``torch.randint(2, (1,))`` is 1, v2 ``torch.rand(()) <= 0.5``."""
    if version == "v1":
        return draws.randint(0, 2) != 0
    return draws.uniform(0, 1) <= 0.5


def _draw_aa(op: Any, version: str, space: dict, draws: Draws) -> Ops:
    policies = op.policies if version == "v1" else op._policies
    out: Ops = []
    if version == "v1":  # v1 draws the policy, both coins and both signs up front
        policy = policies[draws.randint(0, len(policies))]
        probs = torch.rand((2,)).tolist()
        signs = torch.randint(2, (2,)).tolist()
        for i, (name, p, index) in enumerate(policy):
            if not probs[i] <= _f32(p):
                continue
            rule, signed = space[name]
            magnitude = _magnitude(rule, 10, index, version) if index is not None else 0.0
            if signed and signs[i] == 0:
                magnitude *= -1.0
            out.append((name, magnitude))
        return out
    policy = policies[draws.randint(0, len(policies))]
    for name, p, index in policy:  # v2: one coin per op, a sign coin only when applied
        if not draws.uniform(0, 1) <= _f32(p):
            continue
        rule, signed = space[name]
        if rule is None:
            out.append((name, 0.0))
            continue
        magnitude = _magnitude(rule, 10, index, version)
        if signed and draws.uniform(0, 1) <= 0.5:
            magnitude *= -1.0
        out.append((name, magnitude))
    return out


def draw_augmix(op: Any, version: str, h: int, w: int, draws: Optional[Draws] = None
                ) -> tuple[float, list[tuple[float, Ops]]]:
    """AugMix's draws for an h x w image: ``(m0, [(weight_i, ops_i), ...])``.

    ``m0`` is the weight of the original, ``weight_i`` chain i's weight (already the float32
    product ``dirichlet_i * m1``), ``ops_i`` its (name, signed magnitude) list in order, as
    :func:`draw_auto_augment` gives them (v2's Solarize a fraction).

    The mix torchvision then computes, on the uint8 CHW tensor ``x`` (a PIL image is first
    ``pil_to_tensor``-ed), all in float32, one elementwise op at a time (no fused multiply-add)::

        mix = f32(m0) * f32(x)                      # the original
        for weight_i, ops_i in chains:              # in order
            aug = ops_i applied in turn to x        # uint8, each chain from the original
            mix = mix + f32(weight_i) * f32(aug)    # the product rounded first, then the sum
        out = mix.to(uint8)                         # truncation toward zero (mix >= 0)

    and a PIL input gets ``to_pil_image(out)`` back.
    """
    if _family(op) != "augmix":
        raise TypeError("not an AugMix")
    space = _space("augmix", version, h, w, op.all_ops)
    names = list(space)
    m = torch._sample_dirichlet(torch.tensor([op.alpha, op.alpha]).expand(1, -1))
    weights = torch._sample_dirichlet(
        torch.tensor([op.alpha] * op.mixture_width).expand(1, -1)) * m[:, 1].view([1, -1])
    draws = draws or Draws()
    chains = []
    for i in range(op.mixture_width):
        depth = op.chain_depth if op.chain_depth > 0 else draws.randint(1, 4)
        ops: Ops = []
        for _ in range(depth):
            name = names[draws.randint(0, len(names))]
            rule, signed = space[name]
            if rule is None:
                ops.append((name, 0.0))
                continue
            magnitude = _magnitude(rule, 10, draws.randint(0, op.severity), version)
            if signed and _sign_coin(version, draws):
                magnitude *= -1.0
            ops.append((name, magnitude))
        chains.append((float(weights[0, i]), ops))
    return float(m[0, 0]), chains


# ---------------------------------------------------------------- RandomErasing

ErasingValue = Union[tuple[float, ...], torch.Tensor]


def draw_erasing(op: Any, version: str, c: int, h: int, w: int, draws: Optional[Draws] = None
                 ) -> Optional[tuple[int, int, int, int, ErasingValue]]:
    """torchvision ``RandomErasing``'s draws on a (c, h, w) tensor.

    Returns:
        None when the op leaves the image as it is (its ``p`` coin, or no box in its 10 tries:
        v1 then returns the image, or its copy when not ``inplace``, v2 the input itself), else
        ``(i, j, eh, ew, v)``: the box's top, left, height, width and what is written into it,
        ``img[..., i:i+eh, j:j+ew] = v``. ``v`` is a tuple of c floats (float32 values: the
        op writes ``torch.tensor(value)``) for a number or a sequence, or for ``value="random"``
        the float32 (c, eh, ew) tensor of standard normals the op draws. ``inplace`` changes
        no draw.
    """
    draws = draws or Draws()
    if draws.uniform(0, 1) >= _f32(op.p):  # ``torch.rand(1) < p`` (v2: ``>= p`` skips)
        return None
    value = _erasing_value(op, version)
    if value is not None and len(value) not in (1, c):
        raise ValueError(f"RandomErasing value {value} has neither 1 nor {c} (channels) values")
    log_ratio = torch.log(torch.tensor(op.ratio)).tolist()
    area = h * w
    for _ in range(10):
        erase_area = area * draws.uniform(op.scale[0], op.scale[1])
        aspect = draws.exp_uniform(log_ratio[0], log_ratio[1])
        eh = int(round(math.sqrt(erase_area * aspect)))
        ew = int(round(math.sqrt(erase_area / aspect)))
        if not (eh < h and ew < w):
            continue
        if value is None:
            v: ErasingValue = torch.empty([c, eh, ew], dtype=torch.float32).normal_()
        else:
            v = tuple(torch.tensor(value).expand(c).tolist())
        i = draws.randint(0, h - eh + 1)
        j = draws.randint(0, w - ew + 1)
        return i, j, eh, ew, v
    return None


def _erasing_value(op: Any, version: str) -> Optional[list[float]]:
    """The op's value as its forward casts it: a list of floats, or None for "random"."""
    value = op.value
    if version == "v2":  # already cast at construction
        return value
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        return None
    return [float(x) for x in value]


# ---------------------------------------------------------------- timm

# timm's ops whose function picks a resample filter (its ``_check_args_tf``)
TIMM_GEOMETRIC = frozenset({"Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY",
                            "TranslateXRel", "TranslateYRel"})
# timm's ops that draw inside the op itself (not reproduced)
TIMM_UNSUPPORTED = frozenset({"GaussianBlurRand"})


def _resample_name(resample: Any) -> str:
    from PIL import Image
    return Image.Resampling(resample).name.lower()


def draw_timm_rand_augment(t: Any, h: int, w: int) -> list[tuple[str, tuple, Optional[str]]]:
    """timm's ``RandAugment`` (``rand_augment_transform``, as ``create_transform(...,
    auto_augment="rand-...")`` builds it) on an h x w PIL image: per applied op, in order,
    ``(name, level args, resample)``.

    Draws as timm does: numpy's ``np.random.choice`` of the ``num_layers`` ops (with
    replacement unless weighted), then per op Python's ``random``: the ``prob`` coin (when
    ``prob < 1``), the magnitude noise (``gauss`` for ``magnitude_std``, ``uniform(0, m)`` for
    an infinite one), clamped to ``[0, magnitude_max or 10]``, the op's level function (its
    sign coin: the level function is the op's own), and for the geometric ops the resample
    filter (``random.choice`` when the op has several). ``resample`` is "bilinear",
    "bicubic", ... for the geometric ops, None for the others. The args do not depend on the
    image size (TranslateXRel's are a fraction of it); h and w are for symmetry.
    """
    ops = t.ops
    chosen = np.random.choice(len(ops), t.num_layers, replace=t.choice_weights is None,
                              p=t.choice_weights)
    out: list[tuple[str, tuple, Optional[str]]] = []
    for index in chosen:
        op = ops[int(index)]
        if op.name in TIMM_UNSUPPORTED:
            raise ValueError(f"timm's {op.name} draws inside the op: not reproduced")
        if op.prob < 1.0 and random.random() > op.prob:
            continue
        magnitude = op.magnitude
        if op.magnitude_std > 0:
            if op.magnitude_std == float("inf"):
                magnitude = random.uniform(0, magnitude)
            else:
                magnitude = random.gauss(magnitude, op.magnitude_std)
        magnitude = max(0.0, min(magnitude, op.magnitude_max or 10.0))
        args = op.level_fn(magnitude, op.hparams) if op.level_fn is not None else ()
        resample = None
        if op.name in TIMM_GEOMETRIC:
            resample = op.kwargs["resample"]
            if isinstance(resample, (list, tuple)):
                resample = random.choice(resample)
            resample = _resample_name(resample)
        out.append((op.name, tuple(args), resample))
    return out


def draw_timm_erasing(t: Any, c: int, h: int, w: int, dtype: torch.dtype = torch.float32
                      ) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """timm's ``RandomErasing`` on one (c, h, w) image (how ``create_transform(...,
    re_prob=...)`` uses it: after Normalize, per sample): the boxes ``(top, left, eh, ew, v)``
    in the order written, ``img[:, top:top+eh, left:left+ew] = v`` each, ``v`` of ``dtype``:
    zeros (c, 1, 1) for mode "const", per-channel normals (c, 1, 1) for "rand", per-pixel
    normals (c, eh, ew) for "pixel", each drawn with timm's own ``torch.empty(...).normal_()``
    on ``t.device``. Python's ``random``: the probability coin, the count (``randint`` when
    ``min_count < max_count``), per box up to 10 tries of (area ``uniform``, log-aspect
    ``uniform``) and, for the first that fits, top and left ``randint``; a box whose 10 tries
    all fail is skipped. An empty list: nothing erased. (For a 4-D batch timm erases each sample
    in turn, leaving out the first ``B // num_splits`` when ``num_splits > 1``.)"""
    if random.random() > t.probability:
        return []
    area = h * w
    count = t.min_count if t.min_count == t.max_count else random.randint(t.min_count,
                                                                          t.max_count)
    boxes = []
    for _ in range(count):
        for _ in range(10):
            target_area = random.uniform(t.min_area, t.max_area) * area / count
            aspect = math.exp(random.uniform(*t.log_aspect_ratio))
            eh = int(round(math.sqrt(target_area * aspect)))
            ew = int(round(math.sqrt(target_area / aspect)))
            if ew < w and eh < h:
                top = random.randint(0, h - eh)
                left = random.randint(0, w - ew)
                if t.per_pixel:
                    v = torch.empty((c, eh, ew), dtype=dtype, device=t.device).normal_()
                elif t.rand_color:
                    v = torch.empty((c, 1, 1), dtype=dtype, device=t.device).normal_()
                else:
                    v = torch.zeros((c, 1, 1), dtype=dtype, device=t.device)
                boxes.append((top, left, eh, ew, v))
                break
    return boxes
