"""Reading a torchvision ``Compose`` into the fused image path's steps (issue 37).

:func:`read_plan` walks a v1 or v2 ``Compose`` (timm's ``create_transform`` returns a v1 one)
from the front and takes each op whose exact class and arguments map onto a fused step; the
first op that does not map ends the fused prefix, and it and everything after it run as
torchvision's own objects (``Plan.rest``). Reading never guesses: a subclass, an interpolation
other than bilinear, antialias=False on a tensor, a ColorJitter with hue, a geometry op after
the colour jitter or a second resize all end the prefix there.

The image goes through states as torchvision's would: ``pil`` (decoded, uint8 RGB, what the
default loader gives), ``u8`` (a uint8 CHW tensor, after ``PILToTensor``/``ToImage``) and
``float`` (after ``ToTensor``/``ToDtype``/``ConvertImageDtype``, with ``Normalize`` folded in as
a per-channel affine map ``v * mul + add`` of the uint8 value ``v``). Geometry runs only on
``pil`` and ``u8`` images, the colour jitter only on ``pil`` ones (on a tensor torchvision's
own op is as fast as ours); a resize of a ``u8`` tensor only as v2 does it (v2 resizes uint8
natively, v1 in float32 and rounds: a v1 resize of a tensor ends the prefix). A folder whose
loader is ``torchvision.io.decode_image`` starts in the ``u8`` state (``read_plan(...,
start="u8")``): torchvision's uint8 recipe.

Random parameters are drawn as the ops draw them, from the same RNG (torch's global one, or
Python's ``random`` for timm's crop) in the same order as under DataLoader, by the same
sequence of calls as the op's own ``get_params`` / ``make_params`` (:class:`Draws`; the ops'
methods check their input and make a tensor per draw: ~50 us a sample for torchvision's crop;
tests/test_torchvision_draws.py compares each with the op's method; the box itself is drawn by
vision/ops/crop_box.py, for our own op as for torchvision's and timm's). Which ops map, and the
interpolation rule, are vision/torchvision/table.py's. Imports: torch, vision/ops/crop_box.py
and table.py; torchvision inside functions (this module is imported only when torchvision
already is).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pooled_loader.vision.ops.crop_box import PYTHON_RANDOM, resized_crop_box
from pooled_loader.vision.torchvision.table import (AUGMENT, CENTER_CROP, CONVERT, DETECTION,
                                                    ERASE, FLIP, JITTER, RESIZE, RESIZED_CROP,
                                                    op_table, resizes_bilinearly)
from pooled_loader.vision.torchvision.wrappers import MAX_DEPTH, applied_attribute, why_not_read

@dataclass
class Step:
    """One fused op: ``kind``, the user's op object and what the reading fixed about it."""

    kind: str
    op: Any
    version: str  # "v1", "v2" or "timm": how its parameters are drawn
    size: tuple[int, int] | None = None  # crops: the output (height, width)
    log_ratio: tuple[float, float] | None = None  # RandomResizedCrop's, as torchvision has it
    # AUGMENT: "interpolation" ("nearest"/"bilinear"), "fill" (None or 3 floats), "arithmetic"
    # ("pil": the op ran on a PIL image, "tensor": on a uint8 tensor, as AugMix always does)
    params: dict = field(default_factory=dict)


@dataclass
class Plan:
    """The fused prefix (``steps``) and the ops that run as they are (``rest``)."""

    steps: list[Step] = field(default_factory=list)
    rest: list[Any] = field(default_factory=list)
    state: str = "pil"  # where the prefix leaves the image: "pil", "u8" or "float"
    start: str = "pil"  # what the dataset's loader gives: "pil" (PIL) or "u8" (decode_image)
    colorspaces: tuple[str, ...] = ()  # start "u8": the JPEG colour spaces decoded fused
    image_type: bool = False  # a tv_tensors.Image (v2 ToImage) rather than a plain tensor
    mul: tuple[float, ...] = (1.0, 1.0, 1.0)  # float state: value = v * mul + add per channel
    add: tuple[float, ...] = (0.0, 0.0, 0.0)
    python_random: bool = False  # a step draws from Python's random (timm's crop, ...)
    numpy_random: bool = False  # a step draws from numpy's global RNG (timm's RandAugment)
    fused_names: list[str] = field(default_factory=list)
    why_stopped: str = ""  # why the first op of ``rest`` is not fused

    @property
    def geometry(self) -> bool:
        return any(s.kind in (RESIZED_CROP, RESIZE, CENTER_CROP) for s in self.steps)

    def describe(self) -> dict:
        """What ``loader.stats()["transforms"]`` shows: the ops fused and the ops run as is."""
        return {"fused": list(self.fused_names), "as_is": [_name(op) for op in self.rest],
                "output": ("PIL.Image" if self.state == "pil" else
                           ("tv_tensors.Image" if self.image_type else "torch.Tensor")),
                "why_not_fused": self.why_stopped}


def _name(op: Any) -> str:
    return " ".join(repr(op).split())


def _pair(size: Any) -> tuple[int, int] | None:
    if isinstance(size, int):
        return (size, size)
    try:
        size = [int(s) for s in size]
    except TypeError:
        return None
    if len(size) == 1:
        return (size[0], size[0])
    return (size[0], size[1]) if len(size) == 2 else None


def _compose(transform: Any) -> list | None:
    """The ops of a torchvision v1 or v2 ``Compose`` (exact classes), ``[op]`` for one op of
    the table given alone, else None."""
    if type(transform).__module__.split(".")[0] != "torchvision":
        return None  # not torchvision's (our own Compose, a lambda): torchvision may be absent
    import torchvision.transforms as v1
    import torchvision.transforms.v2 as v2
    if type(transform) in (v1.Compose, v2.Compose):
        return list(transform.transforms)
    return [transform] if type(transform) in op_table() else None


def compose_ops(transform: Any) -> list | None:
    """The ops of a torchvision v1 or v2 ``Compose`` (exact classes), set directly or inside
    wrappers whose call only applies it (``wrappers.applied_attribute``), else None."""
    return read_compose(transform)[0]


def read_compose(transform: Any) -> tuple[list | None, str]:
    """(:func:`compose_ops`, ""), or (None, why it is not read: "" for no transform)."""
    inner = transform
    for _ in range(MAX_DEPTH + 1):
        if inner is None:
            return None, ""
        ops = _compose(inner)
        if ops is not None:
            return ops, ""
        unwrapped = applied_attribute(inner)
        if unwrapped is None:
            return None, why_not_read(inner)
        inner = unwrapped
    return None, f"wrappers nested deeper than {MAX_DEPTH}"


class _Reader:
    """Walks the ops, updating the plan; ``take`` returns False for the first op that does not
    map (with ``plan.why_stopped`` saying why)."""

    def __init__(self, start: str) -> None:
        self.plan = Plan(state=start, start=start)
        self.table = op_table()
        self.resized = False  # a resize (or crop) has been taken
        self.cropped = False
        self.jittered = False
        self.augmented = False  # an AutoAugment-family op has been taken
        self.erased = False  # a RandomErasing has been taken: only ToPureTensor may follow

    def stop(self, why: str) -> bool:
        self.plan.why_stopped = why
        return False

    def take(self, op: Any) -> bool:
        found = self.table.get(type(op))
        if found is None or found[0] in DETECTION:  # (a detection op: no classification step)
            return self.stop(f"{type(op).__name__} has no fused equivalent")
        kind, version = found
        plan = self.plan
        if self.erased and not (kind == CONVERT and type(op).__name__ == "ToPureTensor"):
            return self.stop(f"{type(op).__name__} after RandomErasing")
        if kind == AUGMENT:
            ok = self._augment(op, version)
        elif kind == ERASE:
            ok = self._erase(op)
        elif kind in (RESIZED_CROP, RESIZE, CENTER_CROP):
            ok = self._geometry(op, kind, version)
        elif kind == FLIP:
            ok = True
            plan.steps.append(Step(FLIP, op, version))
        elif kind == JITTER:
            ok = self._jitter(op, version)
        else:
            ok = self._convert(op)
        if ok:
            plan.fused_names.append(_name(op))
        return ok

    def _geometry(self, op: Any, kind: str, version: str) -> bool:
        plan = self.plan
        if plan.state not in ("pil", "u8") or (plan.image_type and version == "v1"):
            return self.stop(f"{type(op).__name__} on a {plan.state} image is left to torchvision")
        if self.jittered or self.augmented:
            return self.stop("a geometry op after the colour ops")
        if kind == CENTER_CROP:
            if self.cropped:
                return self.stop("a second CenterCrop")
            self.cropped = True
            plan.steps.append(Step(CENTER_CROP, op, version, _pair(op.size)))
            return True
        if self.resized or self.cropped:
            return self.stop(f"a second resize ({type(op).__name__})")
        if not resizes_bilinearly(op, version, tensor=plan.state == "u8"):
            return self.stop(f"{type(op).__name__}: only bilinear (antialiased) resizing is fused")
        if plan.state == "u8" and version == "v1":  # v1 resizes a uint8 tensor in float32
            return self.stop(f"{type(op).__name__} (v1) of a tensor is left to torchvision")
        size = _pair(op.size) if kind == RESIZED_CROP else None
        if kind == RESIZED_CROP and size is None:
            return self.stop("RandomResizedCrop: size not understood")
        self.resized = True
        plan.python_random |= version == "timm"
        step = Step(kind, op, version, size)
        if kind == RESIZED_CROP and version != "timm":  # float32 logs, as both versions keep
            step.log_ratio = tuple(float(v) for v in torch.log(torch.tensor(op.ratio)))
        plan.steps.append(step)
        return True

    def _augment(self, op: Any, version: str) -> bool:
        """An AutoAugment-family op on the uint8 image (vision/ops/autoaugment.py's kernels)."""
        plan, name = self.plan, type(op).__name__
        if plan.state not in ("pil", "u8") or (plan.image_type and version == "v1"):
            return self.stop(f"{name} on a {plan.state} image is left to torchvision")
        if version == "timm":
            return self._timm_augment(op)
        mode = _mode_name(op.interpolation)
        if mode not in ("nearest", "bilinear"):
            return self.stop(f"{name}: only nearest and bilinear interpolation are fused")
        fill = _fill3(op.fill)
        if fill is False:
            return self.stop(f"{name}: fill {op.fill!r} not understood")
        augmix = name == "AugMix"
        if augmix and (op.mixture_width < 1 or not 1 <= op.severity <= 10):
            return self.stop(f"{name}: its arguments are left to torchvision to check")
        self.augmented = True
        arithmetic = "pil" if plan.state == "pil" and not augmix else "tensor"
        plan.steps.append(Step(AUGMENT, op, version, params={
            "interpolation": mode, "fill": fill, "arithmetic": arithmetic}))
        return True

    def _timm_augment(self, op: Any) -> bool:
        """timm's RandAugment: its ops on a PIL image, drawn from numpy's and Python's RNGs."""
        from pooled_loader.vision.ops.autoaugment import TIMM_OPS
        plan = self.plan
        if plan.state != "pil":
            return self.stop("timm's RandAugment on a tensor is left to timm")
        names = {o.name for o in op.ops}
        if not names <= TIMM_OPS:
            return self.stop(f"timm's RandAugment with {sorted(names - TIMM_OPS)} is left to timm")
        fills = {_fill3(o.kwargs.get("fillcolor")) for o in op.ops}
        if len(fills) != 1 or False in fills:
            return self.stop("timm's RandAugment: fillcolor not understood")
        self.augmented = True
        plan.python_random = plan.numpy_random = True
        plan.steps.append(Step(AUGMENT, op, "timm", params={"fill": fills.pop()}))
        return True

    def _erase(self, op: Any) -> bool:
        """RandomErasing on the float image, in its slot row."""
        if self.plan.state != "float":
            return self.stop(f"RandomErasing of a {self.plan.state} image is left to torchvision")
        if type(op).__module__.startswith("timm"):
            if str(getattr(op, "device", "cpu")) != "cpu":
                return self.stop("timm's RandomErasing on a device is left to timm")
            self.erased = True
            self.plan.python_random = True
            self.plan.steps.append(Step(ERASE, op, "timm"))
            return True
        value = op.value
        if not (value == "random" or value is None or isinstance(value, (int, float))
                or (isinstance(value, (list, tuple)) and len(value) in (1, 3))):
            return self.stop(f"RandomErasing: value {value!r} is left to torchvision")
        self.erased = True
        self.plan.steps.append(Step(ERASE, op, "v2" if "v2" in type(op).__module__ else "v1"))
        return True

    def _jitter(self, op: Any, version: str) -> bool:
        if self.plan.state != "pil":
            return self.stop("ColorJitter on a tensor runs as torchvision's own op")
        if op.hue is not None:
            return self.stop("ColorJitter with hue runs as torchvision's own op")
        self.jittered = True
        self.plan.steps.append(Step(JITTER, op, version))
        return True

    def _convert(self, op: Any) -> bool:
        import torchvision.transforms as v1
        import torchvision.transforms.v2 as v2
        plan, name, cls = self.plan, type(op).__name__, type(op)
        if name in ("ToTensor", "MaybeToTensor"):
            if plan.state != "pil":
                return self.stop(f"{name} of a tensor")
            plan.state, plan.mul = "float", (1 / 255,) * 3
        elif cls in (v1.PILToTensor, v2.PILToTensor):
            if plan.state != "pil":
                return self.stop("PILToTensor of a tensor")
            plan.state = "u8"
        elif cls is v2.ToImage:
            plan.state = "u8" if plan.state == "pil" else plan.state
            plan.image_type = True
        elif cls is v2.ToPureTensor:
            if plan.state == "pil":
                return self.stop("ToPureTensor of a PIL image")
            plan.image_type = False
        elif cls in (v1.ConvertImageDtype, v2.ToDtype):
            dtype = op.dtype
            scale = True if cls is v1.ConvertImageDtype else op.scale
            if dtype is not torch.float32:
                return self.stop(f"{name} to {dtype} is left to torchvision")
            if plan.state == "pil":
                return self.stop(f"{name} of a PIL image")
            if plan.state == "u8":
                plan.state, plan.mul = "float", ((1 / 255,) * 3 if scale else (1.0,) * 3)
        elif cls in (v1.Normalize, v2.Normalize):
            if plan.state != "float":
                return self.stop(f"Normalize of a {plan.state} image")
            try:
                mean = [float(m) for m in op.mean]
                std = [float(s) for s in op.std]
            except TypeError:
                return self.stop("Normalize: mean/std not understood")
            if len(mean) == 1:
                mean *= 3
            if len(std) == 1:
                std *= 3
            if len(mean) != 3 or len(std) != 3 or 0.0 in std:
                return self.stop("Normalize: needs 1 or 3 values and std != 0")
            plan.mul = tuple(m / s for m, s in zip(plan.mul, std))
            plan.add = tuple((a - m) / s for a, m, s in zip(plan.add, mean, std))
        else:
            return self.stop(f"{name} has no fused equivalent")
        return True


def _mode_name(mode: Any) -> str:
    """An op's interpolation as torchvision's ``InterpolationMode`` value ("nearest", ...):
    v1 keeps the enum, v2 a string or the enum."""
    return str(getattr(mode, "value", mode))


def _fill3(fill: Any) -> tuple[float, float, float] | None | bool:
    """An AutoAugment-family op's ``fill`` as the kernels take it: None (zeros) or one value per
    channel; False when it is not understood (then the op is left to torchvision)."""
    if fill is None:
        return None
    if isinstance(fill, (int, float)):
        return (float(fill),) * 3
    try:
        values = [float(f) for f in fill]
    except (TypeError, ValueError):
        return False
    if len(values) == 1:
        values *= 3
    return tuple(values) if len(values) == 3 else False


def read_plan(transform: Any, start: str = "pil") -> Plan | None:
    """The plan for a torchvision ``Compose`` applied to what the loader gives (``start``: a
    PIL image, or "u8", a uint8 CHW tensor); None when nothing of it can be fused (not a
    Compose, or its first op does not map; from a tensor, no resize or crop to fuse)."""
    ops = compose_ops(transform)
    if ops is None:
        return None
    reader = _Reader(start)
    for i, op in enumerate(ops):
        if not reader.take(op):
            reader.plan.rest = ops[i:]
            break
    plan = reader.plan
    if start == "u8":  # fusing the decode alone of a whole image saves nothing
        return plan if plan.geometry else None
    return plan if plan.steps or plan.state != "pil" else None


# -------------------------------------------------------------------------------------------
# drawing parameters with the op's own code

class Draws:
    """The fused ops' random parameters, drawn from the RNG each op draws from, call for call in
    the op's order, so that the values are the ones the op itself would draw.

    torchvision's calls are made on two reused one-element tensors: in ATen ``torch.rand(1)`` is
    ``torch.empty(1).uniform_(0, 1)``, ``torch.randint(a, b, (1,))`` is ``torch.empty(1,
    dtype=torch.int64).random_(a, b)`` and ``torch.exp`` of a tensor is its ``exp_()``, so each
    draw is the same number from the same RNG state without a tensor made per call
    (tests/test_torchvision_swap.py compares every kind of draw with the op's own method over
    many seeds). One per process and thread (a :class:`FusedFolder` owns one)."""

    def __init__(self) -> None:
        self.f32 = torch.empty(1)
        self.i64 = torch.empty(1, dtype=torch.int64)

    def uniform(self, low: float, high: float) -> float:
        """``torch.empty(1).uniform_(low, high).item()``."""
        return self.f32.uniform_(low, high).item()

    def randint(self, low: int, high: int) -> int:
        """``torch.randint(low, high, size=(1,)).item()``."""
        return self.i64.random_(low, high).item()

    # the draws of a RandomResizedCrop's box (vision/ops/crop_box.py's Source)

    def exp_uniform(self, low: float, high: float) -> float:
        """``torch.exp(torch.empty(1).uniform_(low, high)).item()``: exp in float32."""
        return self.f32.uniform_(low, high).exp_().item()

    def randint_incl(self, low: int, high: int) -> int:
        """``torch.randint(low, high + 1, size=(1,)).item()``."""
        return self.i64.random_(low, high + 1).item()

    def box(self, step: Step, h: int, w: int) -> tuple[int, int, int, int]:
        """(top, left, height, width) of a RandomResizedCrop on an h x w image: torchvision's
        v1 ``get_params`` / v2 ``make_params`` (the same algorithm and torch calls) without
        their input checks, or timm's ``get_params`` (Python's ``random``)."""
        op = step.op
        if step.version == "timm":  # Python's random, its own float64 logs; no emptiness check
            log_ratio = (math.log(op.ratio[0]), math.log(op.ratio[1]))
            x0, y0, cw, ch = resized_crop_box(h, w, op.scale, log_ratio, op.ratio,
                                              PYTHON_RANDOM, empty_ok=True)
        else:
            x0, y0, cw, ch = resized_crop_box(h, w, op.scale, step.log_ratio, op.ratio, self)
        return y0, x0, ch, cw

    def flip(self, step: Step) -> bool:
        """torchvision's coin: ``torch.rand(1) < p`` (v2: not ``>= p``, the same draw). torch
        compares in float32, so ``p`` is rounded to float32 first."""
        return self.f32.uniform_(0, 1).item() < float(np.float32(step.op.p))

    def jitter(self, step: Step) -> tuple[list[int], tuple]:
        """ColorJitter's order and factors (brightness, contrast, saturation, hue): v1's
        ``get_params`` and v2's ``make_params`` draw ``torch.randperm(4)`` then one uniform per
        range that is not None, in that order."""
        op = step.op
        order = torch.randperm(4).tolist()
        return order, tuple(None if r is None else self.uniform(r[0], r[1])
                            for r in (op.brightness, op.contrast, op.saturation, op.hue))


def resize_hw(step: Step, h: int, w: int) -> tuple[int, int]:
    """The output (height, width) of a Resize of an h x w image (torchvision's own rule)."""
    from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size
    size = step.op.size
    if isinstance(size, int):
        size = [size]
    out = _compute_resized_output_size((h, w), None if size is None else list(size),
                                       step.op.max_size)
    return int(out[0]), int(out[1])
