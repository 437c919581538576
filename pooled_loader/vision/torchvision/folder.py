"""Run a user's unchanged torchvision ``ImageFolder`` + ``Compose`` on the fused image path.

:func:`translate` recognises a dataset whose samples can be made here exactly as torchvision
makes them: a ``torchvision.datasets.ImageFolder``/``DatasetFolder`` with the default (PIL)
loader or ``torchvision.io.decode_image`` (torchvision's uint8 recipe: see :func:`tensor_loader`)
whose ``__getitem__`` is torchvision's own, or a ``pooled_loader.vision.ImageFolder``, with a v1
or v2 ``Compose`` as ``transform``. It returns a :class:`FusedFolder` that the
loader's workers use in its place (the user's dataset object is not changed); anything else
runs as it is. The Compose is read by ``plan.read_plan``.

Per sample (``FusedFolder.getitem_into``): read the file, read its header, draw every fused
op's parameters in op order with the op's own code, decode only the crop box's region
(``decode.decode_crop_into``, no DCT downscale: see docs/vision.md for why), resize with the
fused kernel reading *only the box* (the kernel is given a view of the box, so its filter is
clipped at the box's edges as torchvision's crop-then-resize is), flip, colour jitter
(``jitter.py``, Pillow's arithmetic), and write the CHW result (uint8, or float32 through the
folded ToTensor/ToDtype/Normalize) straight into the batch slot; then the ops the plan left run
as torchvision's own objects on that tensor (or on a PIL image, where the prefix ended
before the conversion to a tensor). The decoders are the ones Pillow uses (libjpeg-turbo for
JPEGs; Pillow itself, with ``convert("RGB")`` like torchvision's ``pil_loader``, for CMYK,
PNG and the rest); EXIF orientation is not applied, as torchvision's loader does not.

A sample the fused path cannot make (a file our decoder refuses but Pillow might open, a
CenterCrop larger than the image) is made by the dataset's own ``__getitem__`` with the random
state restored to what it was before the fused draws, so the sequence of draws is the same.
"""
from __future__ import annotations

import functools
import logging
import os
import random
import sys
from typing import Any

import numpy as np
import torch

from pooled_loader.core.errors import SampleError
from pooled_loader.core.hooks import LoaderHooks
from pooled_loader.vision.torchvision import augment_draws
from pooled_loader.vision.torchvision import plan as tp
from pooled_loader.vision.io.buffers import Scratch, read_file
from pooled_loader.vision.io.decode import decode_crop_into, read_header
from pooled_loader.vision.ops import autoaugment as aa
from pooled_loader.vision.ops.jitter import jitter_into
from pooled_loader.vision.io.kernels import crop_resize_flip_chw

log = logging.getLogger("pooled_loader")

class _Fallback(Exception):
    """This sample is made by the dataset's own ``__getitem__``."""


def _source(dataset: Any) -> tuple[Any, str, tuple | None]:
    """(transform, "", start) when ``dataset`` is a folder dataset we can read, else (None,
    why, None), why being "" for a dataset that is not a folder dataset at all. ``start`` is
    None for a PIL loader, or the JPEG colour spaces a ``decode_image`` loader's mode gives as
    RGB (``tensor_loader``)."""
    from pooled_loader.vision.folder import ImageFolder as PooledFolder
    if isinstance(dataset, PooledFolder):
        if type(dataset).__getitem__ is not PooledFolder.__getitem__:
            return None, "its __getitem__ is overridden", None
        return dataset.transform, "", None
    folder = sys.modules.get("torchvision.datasets.folder")
    if folder is None or not isinstance(dataset, folder.DatasetFolder):
        return None, "", None  # another dataset (CIFAR10, ...): nothing to say
    if type(dataset).__getitem__ is not folder.DatasetFolder.__getitem__ or \
            getattr(type(dataset), "__getitems__", None) is not None:
        return None, "its __getitem__ is overridden", None
    import torchvision
    loader = getattr(dataset, "loader", None)
    if loader is folder.pil_loader or (loader is folder.default_loader
                                       and torchvision.get_image_backend() == "PIL"):
        return dataset.transform, "", None
    spaces = tensor_loader(loader)
    if spaces is None:
        return None, (f"its loader {getattr(loader, '__name__', loader)!r} is neither the "
                      f"default one nor torchvision.io.decode_image"), None
    return dataset.transform, "", spaces


def tensor_loader(loader: Any) -> tuple[str, ...] | None:
    """The JPEG colour spaces whose decode by ``loader`` we reproduce exactly, when it is
    torchvision's ``decode_image`` or ``read_image`` (or a ``functools.partial`` of one giving
    only ``mode`` UNCHANGED or RGB and ``apply_exif_orientation=False``); else None. Both decode
    with libjpeg-turbo as ours does (tests/test_torchvision_recipe.py compares the pixels); a
    YCbCr JPEG gives RGB in either mode, a grey one 1 channel unchanged (left to torchvision)
    and libjpeg's grey-to-RGB in mode RGB. CMYK/RGB/YCCK JPEGs, PNGs and the rest run as
    torchvision's own decode (the sample's fallback), and so does EXIF: neither applies it."""
    image = sys.modules.get("torchvision.io.image")
    if image is None:
        return None
    kwargs: dict = {}
    if isinstance(loader, functools.partial) and not loader.args:
        loader, kwargs = loader.func, dict(loader.keywords)
    if loader is not image.decode_image and loader is not image.read_image:
        return None
    mode = kwargs.pop("mode", image.ImageReadMode.UNCHANGED)
    if kwargs.pop("apply_exif_orientation", False) is not False or kwargs:
        return None
    if isinstance(mode, str):
        mode = image.ImageReadMode.__members__.get(mode.upper())
    if mode is image.ImageReadMode.UNCHANGED:
        return ("YCbCr",)
    return ("YCbCr", "Gray") if mode is image.ImageReadMode.RGB else None


def translate(dataset: Any, logged: str | None = None, collate_fn: Any = None
              ) -> tuple[FusedFolder | None, str | None]:
    """(a :class:`FusedFolder` running ``dataset``'s samples on the fused path, or None; the
    line that says so, or None when there is nothing to say). The line is logged (INFO,
    "pooled_loader") unless it equals ``logged``, the one logged before. A ``collate_fn`` that
    mixes batches (``batch_mix.read_collate``) is taken over when the plan makes the whole
    float image: the :class:`FusedFolder`'s ``mix``."""
    if "torchvision" not in sys.modules and type(dataset).__module__.split(".")[0] != \
            "pooled_loader":
        return None, None
    transform, why, spaces = _source(dataset)
    if transform is None and not why:
        return None, None
    plan = None
    ops, unread = (None, "") if transform is None else tp.read_compose(transform)
    if ops is not None:
        plan = tp.read_plan(transform, "pil" if spaces is None else "u8")
        if plan is not None and spaces is not None:
            plan.colorspaces = spaces
    fused = None
    if plan is None:
        why = why or unread
        if ops is None and not why:
            return None, None
        line = ("PooledLoader: the torchvision transform runs as it is "
                f"({why or 'its first op has no fused equivalent'})")
    else:
        mix, mix_line = _read_mix(dataset, plan, collate_fn)
        fused = FusedFolder(dataset, plan, mix)
        if any(step.kind == tp.AUGMENT for step in plan.steps):
            _preload_augment()
        d = plan.describe()
        line = ("PooledLoader: accelerated torchvision transform: fused [{}]; as is [{}]{}{}".format(
            ", ".join(d["fused"]), ", ".join(d["as_is"]),
            f" ({d['why_not_fused']})" if d["as_is"] else "", mix_line))
    if line != logged:
        log.info("%s", line)
    return fused, line


def _preload_augment() -> None:
    """Import OpenCV here, once, rather than in every worker's first sample: forked workers
    inherit it (~40 ms of CPU a worker start)."""
    from pooled_loader.vision.io.kernels import _get_cv2
    _get_cv2()


def _read_mix(dataset: Any, plan: tp.Plan, collate_fn: Any) -> tuple[Any, str]:
    """(a ``BatchMix`` for ``collate_fn``, or None; what the INFO line says of it)."""
    if collate_fn is None:
        return None, ""
    from pooled_loader.vision.torchvision.batch_mix import BatchMix, read_collate
    from pooled_loader.vision.torchvision.mix_draws import is_mix, mix_num_classes
    transform = read_collate(collate_fn)
    if transform is None:
        return None, ""  # not default_collate then a transform: nothing to say
    version = is_mix(transform)
    if version is None:
        return None, (f"; collate_fn as is (it applies {type(transform).__name__} after "
                      "default_collate, which is not a MixUp/CutMix this loader reads)")
    if plan.rest or plan.state != "float":
        return None, "; collate_fn as is (its MixUp/CutMix needs the whole float image fused)"
    if getattr(dataset, "target_transform", None) is not None:
        return None, "; collate_fn as is (a target_transform runs before its MixUp/CutMix)"
    num_classes = mix_num_classes(transform)
    if num_classes is None:
        return None, "; collate_fn as is (its mixes disagree on num_classes)"
    mix = BatchMix(transform, version, num_classes)
    return mix, f"; in the slot: collate_fn's {mix.describe()}"


class FusedFolder(LoaderHooks):
    """The user's folder dataset, its samples made on the fused path (see the module
    docstring). ``dataset`` is the user's object; other attributes are read from it."""

    def __init__(self, dataset: Any, plan: tp.Plan, mix: Any = None) -> None:
        self.dataset = dataset
        self.plan = plan
        self.mix = mix  # a batch_mix.BatchMix run on each batch in its slot, or None
        self.pooled = not hasattr(dataset, "target_transform")  # pooled_loader's ImageFolder
        self._reset()

    def _reset(self) -> None:
        plan = self.plan  # the kernel's (v/255 - mean)/std for the folded v * mul + add
        self._mean_std = ([-a / (m * 255) for m, a in zip(plan.mul, plan.add)],
                          [1 / (m * 255) for m in plan.mul])
        self._pid = os.getpid()
        self.scratch = Scratch()
        self.draws = tp.Draws()
        self.fallbacks = 0  # samples made by the dataset's own __getitem__

    def __getstate__(self) -> dict:
        return {"dataset": self.dataset, "plan": self.plan, "pooled": self.pooled,
                "mix": self.mix}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "plan", "mix"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def describe(self) -> dict:
        return self.plan.describe()

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.getitem_into(index, None)

    def getitem_into(self, index: int, out: Any) -> tuple[Any, Any]:
        """The zero-copy protocol (CONTRACTS.md): the image goes into ``out[0]`` when it fits."""
        if os.getpid() != self._pid:
            self._reset()
        path, target = self.dataset.samples[index]
        dst = out[0] if isinstance(out, (tuple, list)) and len(out) == 2 else None
        try:
            image = self._image(path, dst if isinstance(dst, np.ndarray) else None)
        except _Fallback:
            self.fallbacks += 1
            image, target = self._as_is(index, path, target)
        except SampleError as e:
            raise SampleError(f"{path}: {e}") from e
        else:
            if not self.pooled and self.dataset.target_transform is not None:
                target = self.dataset.target_transform(target)
        if self.mix is not None:  # the one-hot row the batch's mix mixes
            row = out[1] if dst is not None and isinstance(out[1], np.ndarray) and \
                out[1].shape == (self.mix.num_classes,) else None
            target = self.mix.one_hot_into(target, row)
        return image, target

    def pooled_finish_batch(self, leaves: list) -> type | None:
        """The collate_fn's MixUp/CutMix on the batch in its slot (LoaderHooks)."""
        if self.mix is None:
            return None
        self.mix.apply(leaves[0], leaves[1])
        return tuple

    def _as_is(self, index: int, path: str, target: Any) -> tuple[Any, Any]:
        """The sample as torchvision makes it: the dataset's own ``__getitem__``; for
        pooled_loader's ImageFolder (whose items are encoded bytes) torchvision's ``pil_loader``
        and the transform."""
        if not self.pooled:
            return self.dataset[index]
        from PIL import Image
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        return self.dataset.transform(image), target

    # -- one image

    def _image(self, path: str, dst: np.ndarray | None) -> Any:
        return self._image_from(read_file(path, self.scratch), dst)

    def _image_from(self, data: Any, dst: np.ndarray | None) -> Any:
        """The image from the encoded file ``data`` (read from disk, or held in memory: the
        Ray UDF's rows); raises :class:`_Fallback`, the random state as it was, for one the
        fused path cannot make."""
        try:
            hdr = read_header(data)
        except SampleError:
            raise _Fallback from None  # torchvision's loader raises (or opens it) its own way
        plan = self.plan
        if plan.start == "u8" and not (hdr.turbo and hdr.frame is not None
                                       and hdr.frame.colorspace in plan.colorspaces):
            raise _Fallback  # decode_image's own output (channels, colour conversion)
        saved = (torch.get_rng_state(), random.getstate() if plan.python_random else None,
                 np.random.get_state() if plan.numpy_random else None)
        geo = draw_params(plan, self.draws, hdr.height, hdr.width)
        if geo is None:
            _restore(saved)
            raise _Fallback
        box = geo["box"]
        try:
            crop = decode_crop_into(data, hdr, lambda n: self.scratch.flat("decode", n), 1, box,
                                    geo["resize_hw"])
        except SampleError:
            _restore(saved)
            raise _Fallback from None
        x0, y0, bw, bh = crop.box
        src = crop.image[y0:y0 + bh, x0:x0 + bw]  # the kernel reads only the box
        return self._render(src, geo, dst)

    def _render(self, src: np.ndarray, geo: dict, dst: np.ndarray | None) -> Any:
        plan = self.plan
        rh, rw = geo["resize_hw"]
        crop = geo["crop"]
        oh, ow = (crop[2], crop[3]) if crop else (rh, rw)
        as_float = plan.state == "float"
        shape = (3, oh, ow)
        direct = not plan.rest and plan.state != "pil"
        dtype = np.float32 if as_float else np.uint8
        if direct and dst is not None and dst.shape == shape and dst.dtype == dtype \
                and dst.flags.c_contiguous and dst.flags.writeable:
            out = dst
        else:
            out = np.empty(shape, dtype)
        flip = geo["flip"]
        pixel = geo["pixel"]
        fold = as_float and not crop and geo["jitter"] is None and pixel is None
        if fold:  # the whole chain in one kernel call
            crop_resize_flip_chw(src, (0, 0, src.shape[1], src.shape[0]), out, flip,
                                 *self._mean_std)
        else:
            u8 = out if not as_float else self.scratch.array("u8", shape, np.uint8)
            render_geometry(src, geo, u8, self.scratch)
            jitters = geo["jitter"] or []
            if pixel is not None:  # the colour steps in turn, in place
                self._colour_steps(u8, pixel)
                jitters = []
            if as_float or jitters:  # the jitter, then the float values
                jitter_into(u8, jitters, self.scratch, out if as_float else None,
                            plan.mul, plan.add)
        if geo["erase"] is not None:
            _erase(out, geo["erase"])
        if out is dst:  # the slot's row, returned as it is: the loader does not copy it, and
            return out  # a batch of these is the plain tensor a batch of torchvision's makes
        return self._finish(out)

    def _colour_steps(self, u8: np.ndarray, pixel: list) -> None:
        """Colour jitters and AutoAugment-family ops on the uint8 CHW image, in op order."""
        for step, drawn in pixel:
            if step.kind == tp.JITTER:
                jitter_into(u8, [drawn], self.scratch)
                continue
            p = step.params
            if step.version == "timm":
                for name, args, resample in drawn:
                    aa.apply_timm_op(u8, name, args, resample=resample or "bilinear",
                                     fill=p["fill"], scratch=self.scratch)
                continue
            if type(step.op).__name__ == "AugMix":
                m0, chains = drawn
                if step.version == "v2":
                    chains = [(weight, _as_v1(ops)) for weight, ops in chains]
                aa.augmix_mix(u8, m0, chains, interpolation=p["interpolation"],
                              fill=p["fill"], scratch=self.scratch)
                continue
            for name, magnitude in (_as_v1(drawn) if step.version == "v2" else drawn):
                aa.apply_op(u8, name, magnitude, interpolation=p["interpolation"],
                            fill=p["fill"], arithmetic=p["arithmetic"], scratch=self.scratch)

    def _finish(self, arr: np.ndarray) -> Any:
        plan = self.plan
        if plan.state == "pil":
            from PIL import Image
            x: Any = Image.fromarray(np.ascontiguousarray(arr.transpose(1, 2, 0)), "RGB")
        else:
            x = torch.from_numpy(arr)
            if plan.image_type:
                from torchvision import tv_tensors
                x = x.as_subclass(tv_tensors.Image)
        for op in plan.rest:
            x = op(x)
        return x

    def __repr__(self) -> str:
        return f"FusedFolder({self.dataset!r}, {self.plan.describe()})"


def render_geometry(src: np.ndarray, geo: dict, u8: np.ndarray, scratch: Scratch) -> None:
    """``geo``'s resize, crop and flip of ``src`` (a view of the drawn box) into the uint8 CHW
    ``u8``: one kernel call, or, with a CenterCrop after the resize, the resize into scratch and
    the crop's window copied (mirrored when flipped)."""
    whole = (0, 0, src.shape[1], src.shape[0])
    crop = geo["crop"]
    if not crop:
        crop_resize_flip_chw(src, whole, u8, geo["flip"])
        return
    rh, rw = geo["resize_hw"]
    full = scratch.array("resized", (3, rh, rw), np.uint8)
    crop_resize_flip_chw(src, whole, full)
    top, left, oh, ow = crop
    window = full[:, top:top + oh, left:left + ow]
    np.copyto(u8, window[:, :, ::-1] if geo["flip"] else window)


def _as_v1(ops: list) -> list:
    """v2's (op, magnitude) pairs as v1's ``_apply_op`` takes them: v2 gives Solarize's
    threshold as a fraction of 255 (and multiplies it in float64 when it applies the op)."""
    return [(name, 255.0 * m if name == "Solarize" else m) for name, m in ops]


def _erase(out: np.ndarray, boxes: list) -> None:
    """RandomErasing's boxes (top, left, h, w, value) written into the float CHW image in
    turn: one value per channel, or the op's own values (a (c, h, w) or (c, 1, 1) tensor)."""
    for top, left, h, w, value in boxes:
        region = out[:, top:top + h, left:left + w]
        if isinstance(value, torch.Tensor):
            np.copyto(region, value.numpy())  # broadcasts a (c, 1, 1) value
        else:
            region[...] = np.asarray(value, np.float32).reshape(-1, 1, 1)


def _restore(saved: tuple) -> None:
    torch.set_rng_state(saved[0])
    if saved[1] is not None:
        random.setstate(saved[1])
    if saved[2] is not None:
        np.random.set_state(saved[2])


def draw_params(plan: tp.Plan, draws: tp.Draws, h: int, w: int) -> dict | None:
    """Every fused op's parameters, drawn in op order, and the geometry they give on the
    source image: ``box`` (x0, y0, w, h), ``resize_hw``, ``crop`` (top, left, h, w on the
    unflipped resized image, or None), the final ``flip``, the ``jitter`` parameters, ``pixel``
    (None when the colour steps are jitters alone, else every colour step and its draw, in op
    order: an AutoAugment-family op among them) and ``erase`` (RandomErasing's box and value,
    or None). None when this image needs what the fused path does not do (a crop larger than
    the image)."""
    box = (0, 0, w, h)  # on the source, unflipped
    cur_h, cur_w = h, w  # the current image's size
    resized = False
    flipped = False
    crop = None
    jitter = None
    pixel: list = []  # the colour steps in op order: (step, its draw)
    erase = None
    for step in plan.steps:
        kind = step.kind
        if kind == tp.FLIP:
            flipped ^= draws.flip(step)
        elif kind == tp.RESIZED_CROP:
            top, left, bh, bw = draws.box(step, cur_h, cur_w)
            x0 = w - left - bw if flipped else left
            box = (x0, top, bw, bh)
            cur_h, cur_w = step.size
            resized = True
        elif kind == tp.RESIZE:
            cur_h, cur_w = tp.resize_hw(step, cur_h, cur_w)
            resized = True
        elif kind == tp.CENTER_CROP:
            ch, cw = step.size
            if ch > cur_h or cw > cur_w:
                return None
            top, left = int(round((cur_h - ch) / 2.0)), int(round((cur_w - cw) / 2.0))
            left = cur_w - left - cw if flipped else left
            if resized:
                crop = (top, left, ch, cw)
            else:  # a crop of the source: the box itself, resized 1:1
                box = (left, top, cw, ch)
            cur_h, cur_w = ch, cw
        elif kind == tp.JITTER:
            jitter = (jitter or []) + [draws.jitter(step)]
            pixel.append((step, jitter[-1]))
        elif kind == tp.AUGMENT:
            if step.version == "timm":
                drawn = augment_draws.draw_timm_rand_augment(step.op, cur_h, cur_w)
            elif type(step.op).__name__ == "AugMix":
                drawn = augment_draws.draw_augmix(step.op, step.version, cur_h, cur_w)
            else:
                drawn = augment_draws.draw_auto_augment(step.op, step.version, cur_h, cur_w,
                                                        draws)
            pixel.append((step, drawn))
        elif kind == tp.ERASE:
            erase = (augment_draws.draw_timm_erasing(step.op, 3, cur_h, cur_w)
                     if step.version == "timm" else
                     [augment_draws.draw_erasing(step.op, step.version, 3, cur_h, cur_w)])
            erase = [box for box in erase if box is not None] or None
    resize_hw = (cur_h, cur_w) if not crop else _resized_hw(plan, h, w, box)
    return {"box": box, "resize_hw": resize_hw, "crop": crop, "flip": flipped,
            "jitter": jitter, "pixel": pixel if len(pixel) != len(jitter or ()) else None,
            "erase": erase}


def _resized_hw(plan: tp.Plan, h: int, w: int, box: tuple) -> tuple[int, int]:
    """The resize's output size, when a CenterCrop follows it."""
    for step in plan.steps:
        if step.kind == tp.RESIZED_CROP:
            return step.size
        if step.kind == tp.RESIZE:
            return tp.resize_hw(step, h, w)
    return (box[3], box[2])
