"""A clip's transform: a torchvision ``Compose`` on a ``tv_tensors.Video`` read into fused steps.

torchvision's v2 ops on a video (``T, C, H, W``) draw their parameters once per call, so every
frame of a clip gets the same RandomResizedCrop box and the same flip. :class:`ClipTransform`
reads the user's unchanged ``Compose`` with the image path's reader (``vision.torchvision.plan``,
from a uint8 tensor, the state a decoded video is in) and keeps the prefix of crops, resizes,
flips and conversions (``ToDtype(float32, scale=True)``, ``Normalize``): those are drawn once
per clip, with the ops' own draws (``folder.draw_params``), then each frame goes through the
fused kernel (crop, resize, flip, to CHW, to float and normalised) straight into its row of the
batch slot. The first op of another kind (a colour jitter, an AutoAugment op, RandomErasing,
``UniformTemporalSubsample``, anything unknown) ends the prefix: it and the ops after it run as
torchvision's own on the fused output, and :meth:`describe` says which op stopped the reading
and why. Without torchvision's ``Compose``, the transform runs as it is on the decoded clip.

Imports torchvision only where a transform was given (its ``Compose`` is then imported).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from pooled_loader.vision.io.buffers import Scratch
from pooled_loader.vision.io.kernels import crop_resize_flip_chw
from pooled_loader.vision.ops.jitter import jitter_into

__all__ = ["ClipTransform"]

GEOMETRY = ("resized_crop", "resize", "center_crop", "flip")  # the plan's kinds a clip fuses


def _read(transform: Any) -> tuple[Any, list, str]:
    """(plan or None, the ops that run as torchvision's, why the fused prefix ends)."""
    if transform is None:
        return None, [], ""
    if "torchvision" not in sys.modules:
        return None, [transform], "not a torchvision Compose"
    from pooled_loader.vision.torchvision import plan as tp
    ops = tp.compose_ops(transform)
    if ops is None:
        return None, [transform], "not a torchvision Compose"
    cut, why = len(ops), ""
    plan = tp.read_plan(transform, start="u8")
    if plan is not None:
        for step in plan.steps:
            if step.kind not in GEOMETRY and step.kind != "convert":
                cut = next(i for i, op in enumerate(ops) if op is step.op)
                why = f"{type(step.op).__name__}: a clip fuses crops, resizes and flips only"
                break
        else:
            cut = len(ops) - len(plan.rest)
            why = plan.why_stopped
        if plan.image_type:
            cut, why = 0, "ToImage: the clip would become an image"
    if cut < len(ops) and cut > 0:
        from torchvision.transforms import v2
        plan = tp.read_plan(v2.Compose(ops[:cut]), start="u8")
    if plan is None or cut == 0:
        return None, ops, why or "no crop or resize in it to fuse"
    return plan, ops[cut:], why if cut < len(ops) else ""


class ClipTransform:
    """The transform of :class:`~pooled_loader.video.VideoClips`, read once (see the module
    docstring). One per worker process (it holds scratch buffers)."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform
        self.plan, self.rest, self.why = _read(transform)
        plan = self.plan
        self.as_float = plan is not None and plan.state == "float"
        self._mean_std = (([-a / (m * 255) for m, a in zip(plan.mul, plan.add)],
                           [1 / (m * 255) for m in plan.mul]) if self.as_float else (None, None))
        self.scratch = Scratch()
        self._draws = None

    def __getstate__(self) -> dict:
        return {"transform": self.transform}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["transform"])

    def describe(self) -> dict:
        """What is fused and what runs as torchvision's own, and why."""
        fused = self.plan.describe() if self.plan is not None else {}
        return {"fused": fused, "as_is": [type(op).__name__ for op in self.rest],
                "why_not_fused": self.why}

    @property
    def fused(self) -> bool:
        return self.plan is not None

    def draw(self, h: int, w: int) -> dict | None:
        """The clip's geometry, drawn from torch's global RNG as the ops draw (None when the
        plan cannot be applied to an h x w video: a CenterCrop larger than it)."""
        from pooled_loader.vision.torchvision import plan as tp
        from pooled_loader.vision.torchvision.folder import draw_params
        if self._draws is None:
            self._draws = tp.Draws()
        return draw_params(self.plan, self._draws, h, w)

    def frame_shape(self, geo: dict) -> tuple[int, int, int]:
        crop = geo["crop"]
        oh, ow = (crop[2], crop[3]) if crop else geo["resize_hw"]
        return 3, oh, ow

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.as_float else np.uint8)

    def render(self, rgb: np.ndarray, geo: dict, out: np.ndarray) -> None:
        """One decoded ``(H, W, 3)`` frame into ``out`` (``frame_shape``, ``dtype``), as the
        image path renders an image's geometry (``folder.render_geometry``)."""
        from pooled_loader.vision.torchvision.folder import render_geometry
        x0, y0, bw, bh = geo["box"]
        src = rgb[y0:y0 + bh, x0:x0 + bw]  # the kernel reads only the box, as a crop does
        if self.as_float and not geo["crop"]:  # the whole chain in one kernel call
            crop_resize_flip_chw(src, (0, 0, bw, bh), out, geo["flip"], *self._mean_std)
            return
        if not self.as_float:
            render_geometry(src, geo, out, self.scratch)
            return
        u8 = self.scratch.array("u8", out.shape, np.uint8)
        render_geometry(src, geo, u8, self.scratch)
        plan = self.plan
        jitter_into(u8, [], self.scratch, out, plan.mul, plan.add)  # the float values only

    def finish(self, clip: Any) -> Any:
        """The ops left to torchvision, on the clip as a ``tv_tensors.Video`` (or, without
        torchvision, the transform itself on the tensor)."""
        import torch
        x: Any = torch.from_numpy(clip) if isinstance(clip, np.ndarray) else clip
        if not self.rest:
            return x
        if "torchvision" in sys.modules:
            from torchvision import tv_tensors
            x = tv_tensors.Video(x)
        for op in self.rest:
            x = op(x)
        return x
