"""``VideoClips``: clips of videos as a map-style dataset whose frames go straight into the slot.

Item ``i`` is clip ``i % clips_per_video`` of video ``i // clips_per_video``. A clip is
``frames_per_clip`` frames, ``frame_step`` frames of the video apart (or ``1/fps`` seconds apart
with ``fps=``). Where it starts, and every random parameter of the transform, is a function of
``(seed, epoch, i)`` alone (``core.seeds.sample_seed``): the same in any worker, with any number
of workers or ranks, after any resume. ``epoch`` is the loader's epoch under ``PooledLoader``
(its count of epochs, which a resume restores: ``core.seeds.loader_epoch``) and the value of
``set_epoch`` elsewhere (DataLoader, direct indexing).

Per clip: open the file (``sources``), check its header (``container``), place the clip on the
header's frame grid (``sampler="random"``: a start drawn uniformly; ``"uniform"``: the centres
of ``clips_per_video`` equal segments), seek to the keyframe before it and decode forward,
converting only the clip's frames (FFmpeg's own conversion to RGB) and writing each through the
fused kernel into its row of the batch slot (``getitem_into``; ``transform``).
"""
from __future__ import annotations

import os
import random
import time
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from pooled_loader.core.errors import SampleError
from pooled_loader.core.seeds import loader_epoch, sample_seed
from pooled_loader.video.container import MAX_DECODED, open_video, to_rgb
from pooled_loader.video.sources import video_table
from pooled_loader.video.transform import ClipTransform

__all__ = ["VideoClips", "MAX_CLIP_FRAMES"]

MAX_CLIP_FRAMES = 1024
SAMPLERS = ("random", "uniform")


def _positive_int(name: str, value: Any, most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"VideoClips: {name} must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"VideoClips: {name}={value} is more than {most}")
    return int(value)


class VideoClips:
    """Clips ``(T, C, H, W)`` of the videos in ``source``, with their labels.

    Args:
        source: a folder of class folders (Kinetics/UCF101 layout: labels numbered as
            torchvision's ``ImageFolder`` numbers them), local WebDataset ``.tar`` shards (a
            path, a brace pattern or a list; a sample's ``.mp4``/``.webm``/... member, its
            ``.cls`` label), or a list of paths or ``(path, label)`` pairs.
        frames_per_clip: frames in a clip (T).
        frame_step: frames of the video between two frames of a clip.
        fps: instead of ``frame_step``: the clip's frame rate (the frame shown at each
            ``1/fps`` step is taken, whatever the video's rate, variable rates included).
        clips_per_video: clips per video per epoch (the dataset's length is videos x this).
        sampler: ``"random"`` (a start drawn per clip and epoch) or ``"uniform"`` (evenly
            spaced, the same every epoch).
        transform: a torchvision ``Compose`` (v2 or v1) applied to the clip as to a
            ``tv_tensors.Video``: crops, resizes, flips and the conversion to normalised float
            are fused and written into the slot; other ops run as torchvision's own after them
            (``describe()`` says which and why). Any other callable gets the uint8 clip tensor.
        seed: the base of every random draw.
        return_timestamps: items are ``(clip, label, timestamps)``, the seconds (from the
            stream's start) of the frames shown, float64.
        decode_timeout_s: a clip that takes longer to open and decode raises ``SampleError``.
        decoder_threads: FFmpeg threads per clip (1: the loader's workers are the parallelism).
    """

    def __init__(self, source: Any, *, frames_per_clip: int, frame_step: int = 1,
                 fps: float | None = None, clips_per_video: int = 1, sampler: str = "random",
                 transform: Any = None, seed: int = 0, return_timestamps: bool = False,
                 decode_timeout_s: float = 60.0, decoder_threads: int = 1) -> None:
        self.frames_per_clip = _positive_int("frames_per_clip", frames_per_clip, MAX_CLIP_FRAMES)
        self.frame_step = _positive_int("frame_step", frame_step, MAX_DECODED)
        if fps is not None:
            if frame_step != 1:
                raise ValueError("VideoClips: give frame_step or fps, not both")
            if not 0 < float(fps) <= 1000:
                raise ValueError(f"VideoClips: fps must be in (0, 1000], got {fps!r}")
        self.fps = None if fps is None else Fraction(fps).limit_denominator(1001)
        self.clips_per_video = _positive_int("clips_per_video", clips_per_video)
        if sampler not in SAMPLERS:
            raise ValueError(f"VideoClips: sampler must be one of {SAMPLERS}, got {sampler!r}")
        if not float(decode_timeout_s) > 0:
            raise ValueError(f"VideoClips: decode_timeout_s must be > 0, got {decode_timeout_s}")
        self.sampler, self.seed = sampler, int(seed)
        self.return_timestamps = bool(return_timestamps)
        self.decode_timeout_s = float(decode_timeout_s)
        self.decoder_threads = _positive_int("decoder_threads", decoder_threads, 64)
        self.table = video_table(source)
        self.classes = self.table.classes
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.transform = transform
        self._clip = ClipTransform(transform)
        self.epoch = 0

    # -- the dataset -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.table) * self.clips_per_video

    def set_epoch(self, epoch: int) -> None:
        """The epoch outside PooledLoader (under it, the loader's own count is used)."""
        self.epoch = int(epoch)

    def describe(self) -> dict:
        """What of the transform is fused into the slot and what runs as torchvision's."""
        return self._clip.describe()

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return self.getitem_into(index, None)

    def getitem_into(self, index: int, out: Any) -> tuple[Any, ...]:
        """The zero-copy protocol (CONTRACTS.md): the clip goes into ``out[0]`` when it fits."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"VideoClips: index {index} out of range ({len(self)} clips)")
        video = index // self.clips_per_video
        dst = out[0] if isinstance(out, (tuple, list)) and out else None
        name = self.table.name(video)
        try:
            clip, stamps = self._make(index, video, dst if isinstance(dst, np.ndarray) else None)
        except SampleError as e:
            raise SampleError(f"{name}: {e}") from e
        except (OSError, ValueError, MemoryError) as e:
            raise SampleError(f"{name}: {type(e).__name__}: {e}") from e
        label = self.table.label(video)
        if self.return_timestamps:
            return clip, label, stamps
        return clip, label

    # -- one clip ------------------------------------------------------------------------------
    def _epoch(self) -> int:
        epoch = loader_epoch()
        return self.epoch if epoch is None else epoch

    def _targets(self, info: Any, index: int, seed: int) -> list[int]:
        """The clip's times, in the stream's time-base units: half a frame after each frame's
        nominal time, so the frame nearest each time is taken, whatever the muxer rounded its
        timestamp to (WebM keeps milliseconds: frame 23 at 30 fps is at 767, not 766.67)."""
        t = self.frames_per_clip
        per_frame = 1 / (info.fps * info.time_base)  # time-base units a frame of the video
        if self.fps is None:  # frames of the video's grid
            span = (t - 1) * self.frame_step + 1
            step = per_frame * self.frame_step
        else:
            span = int((t - 1) * info.fps / self.fps) + 1
            step = 1 / (self.fps * info.time_base)
        room = info.num_frames - span
        if room < 0:
            raise SampleError(f"a clip of {t} frames spans {span} frames of the video, which "
                              f"has {info.num_frames} (header)")
        if self.sampler == "random":
            first = random.Random(seed).randrange(room + 1)
        else:
            k = index % self.clips_per_video
            first = int((2 * k + 1) * (room + 1) // (2 * self.clips_per_video))
        start = (2 * first + 1) * per_frame / 2
        # start + j * step on one denominator: integer arithmetic per frame, floored
        a = start.numerator * step.denominator
        b = step.numerator * start.denominator
        d = start.denominator * step.denominator
        return [info.start_pts + (a + j * b) // d for j in range(t)]

    def _make(self, index: int, video: int, dst: np.ndarray | None) -> tuple[Any, Any]:
        seed = sample_seed(self.seed, self._epoch(), index)
        deadline = time.monotonic() + self.decode_timeout_s
        clip_t = self._clip
        with self.table.open(video) as f:
            with open_video(f, threads=self.decoder_threads,
                            timeout_s=self.decode_timeout_s) as v:
                info = v.info
                targets = self._targets(info, index, seed)
                saved = torch.get_rng_state()
                torch.default_generator.manual_seed(seed)
                try:
                    geo = clip_t.draw(info.height, info.width) if clip_t.fused else None
                    if clip_t.fused and geo is None:
                        raise SampleError(f"{info.width}x{info.height} is smaller than the "
                                          "transform's CenterCrop")
                    shape = ((len(targets),) + (clip_t.frame_shape(geo) if geo else
                                                (3, info.height, info.width)))
                    dtype = clip_t.dtype
                    direct = (dst is not None and not clip_t.rest and dst.shape == shape
                              and dst.dtype == dtype and dst.flags.c_contiguous)
                    clip = dst if direct else np.empty(shape, dtype)
                    stamps = np.empty(len(targets), np.float64)
                    last: list = [None, None]  # the frame converted last, and its RGB

                    def emit(j: int, frame: Any, pts: int) -> None:
                        if frame is not last[0]:
                            last[0], last[1] = frame, to_rgb(frame)
                        if geo is not None:
                            clip_t.render(last[1], geo, clip[j])
                        else:
                            np.copyto(clip[j], last[1].transpose(2, 0, 1))
                        stamps[j] = float((pts - info.start_pts) * info.time_base)

                    v.frames_at(targets, emit, deadline=deadline)
                    if clip is dst:
                        return clip, stamps
                    return clip_t.finish(clip), stamps
                finally:
                    torch.set_rng_state(saved)

    def __repr__(self) -> str:
        how = f"fps={float(self.fps)}" if self.fps is not None else f"frame_step={self.frame_step}"
        return (f"VideoClips({len(self.table)} videos x {self.clips_per_video} clips, "
                f"frames_per_clip={self.frames_per_clip}, {how}, sampler={self.sampler!r}, "
                f"transform={self.transform!r})")
