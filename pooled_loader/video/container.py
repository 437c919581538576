"""One video opened for a clip: its header read and bounded, the frames shown at given times
decoded from the keyframe before the first, under a deadline.

The decoder is FFmpeg through PyAV, which ships its own FFmpeg libraries (``pip install av``: no
system package). torchcodec decodes with the same FFmpeg but loads the system's libraries; on a
machine without them it cannot start, and where it can, a clip costs the same (BENCHMARKS.md,
issue 49), so PyAV is the one decoder.

Every file is untrusted, and nothing here allocates by what a header claims:

- at most ``MAX_STREAMS`` streams; a video stream must exist (an audio-only file is named so);
- the frame size (``MAX_SIDE``, ``MAX_PIXELS``), the frame rate (``MAX_FPS``) and the duration
  (``MAX_DURATION_S``) are checked before a frame is decoded, and every decoded frame must have
  the header's size;
- the header's frame count and duration only place the clip: a clip past the real end (a
  truncated file, a header that lies) raises ``SampleError`` when the stream ends first;
- a clip decodes at most ``MAX_DECODED`` frames (the keyframe interval plus the clip) and stops
  at ``deadline`` (a monotonic time), each checked per frame.

Frames are picked by presentation time: the frame shown at time ``t`` is the last frame whose
timestamp is at or before ``t``, so variable frame rates and sampling at another rate than the
video's (``fps=``) need no frame table. Imports PyAV (av) inside :func:`open_video` only.
"""
from __future__ import annotations

import bisect
import errno
import itertools
import math
import os
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterator

import numpy as np

from pooled_loader.core.errors import SampleError

__all__ = ["VideoInfo", "Video", "open_video", "to_rgb", "MAX_STREAMS", "MAX_SIDE", "MAX_PIXELS",
           "MAX_FPS", "MAX_DURATION_S", "MAX_DECODED"]

MAX_STREAMS = 64  # a container with more is refused before any is decoded
MAX_SIDE = 16384  # pixels, either side of a frame
MAX_PIXELS = 1 << 25  # per frame: 8K UHD (7680 x 4320) fits, a decoder's worst case stays bounded
MAX_FPS = 1000
MAX_DURATION_S = 7 * 24 * 3600
MAX_DECODED = 4096  # frames decoded for one clip: a keyframe interval longer than this is refused

INSTALL = "pip install 'pooled-loader[video]'"
_BOUNDS = {"max_pixels": str(MAX_PIXELS)}  # FFmpeg's own bound on a frame it allocates


@dataclass(frozen=True)
class VideoInfo:
    """What the header says, checked: the frame size, the nominal rate and frame count (from
    the stream's own count where the container has one, else duration x rate)."""
    width: int
    height: int
    fps: Fraction
    num_frames: int
    time_base: Fraction
    start_pts: int
    codec: str


def _av() -> Any:
    try:
        import av
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"pooled_loader.video decodes with PyAV (av is not installed): "
                                  f"{INSTALL}", name="av") from e
    return av


def _reason(exc: BaseException) -> str:
    # FFmpeg's errors carry the name PyAV gave the input (a file object's descriptor number):
    # the caller names the file, so only the reason is kept
    text = getattr(exc, "strerror", None) or str(exc)
    return f"{type(exc).__name__}: {text}"


class Video:
    """An open video's first video stream (use as a context manager)."""

    def __init__(self, container: Any, stream: Any, info: VideoInfo) -> None:
        self.container, self.stream, self.info = container, stream, info

    def __enter__(self) -> "Video":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.container.close()

    def _decoded(self, targets: list[int]) -> Iterator[Any]:
        """The frames after the last seek, in order. A packet whose frame is shown at none of
        ``targets`` (``[pts, pts + duration)`` holds none) is decoded with
        ``skip_frame="NONREF"``: a frame nothing references and nobody sees is not decoded at
        all (x264's unreferenced B-frames: ~45% of its frames; 46 -> 33 frames decoded for a
        16-frame clip, BENCHMARKS.md). References are decoded as always; a packet without a
        duration is always decoded."""
        cc, skipping = self.stream.codec_context, False
        for packet in self.container.demux(self.stream):
            pts, duration = packet.pts, packet.duration
            skip = False
            if pts is not None and duration and duration > 0:
                k = bisect.bisect_left(targets, pts)
                skip = not (k < len(targets) and targets[k] < pts + duration)
            if skip != skipping:
                cc.skip_frame = "NONREF" if skip else "DEFAULT"
                skipping = skip
            yield from cc.decode(packet)

    def _decode_from(self, targets: list[int], period: int) -> Iterator[Any]:
        """Frames decoded from a keyframe shown at or before ``targets[0]``. FFmpeg's MP4 seek
        goes by decoding time: with B-frames and a variable frame rate, the keyframe it lands
        on can be shown after the target (x264 in MP4), and its first frame is then not the one
        shown then: seek again, further back each time (at most ~log2(length) more)."""
        target = targets[0]
        to, back = target, period
        while True:
            self.container.seek(to, stream=self.stream, backward=True, any_frame=False)
            frames = self._decoded(targets)
            first = next(frames, None)
            if (first is None or first.pts is None or first.pts <= target
                    or to <= self.info.start_pts):
                return itertools.chain(() if first is None else (first,), frames)
            to, back = max(self.info.start_pts, target - back), back * 2

    def frames_at(self, targets: list[int], emit: Callable[[int, Any, int], None], *,
                  deadline: float) -> None:
        """``emit(j, frame, pts)`` for each target ``j`` (stream time-base units, increasing): the
        frame shown at ``targets[j]``. Raises ``SampleError`` when the stream ends before the
        last target, on a decoding error, past ``MAX_DECODED`` frames or past ``deadline``."""
        av = _av()
        info = self.info
        period = max(1, int(1 / (info.fps * info.time_base)))  # one frame, in time-base units
        j, prev, prev_pts, decoded = 0, None, None, 0
        try:
            for frame in self._decode_from(targets, period):
                decoded += 1
                if decoded > MAX_DECODED:
                    raise SampleError(f"{MAX_DECODED} frames decoded from the keyframe before "
                                      f"the clip without reaching its end (keyframes too far "
                                      "apart, or timestamps that do not advance)")
                if time.monotonic() > deadline:
                    raise SampleError(f"decoding took longer than the deadline ({decoded} "
                                      "frames decoded)")
                pts = frame.pts
                if pts is None:
                    raise SampleError("a frame without a timestamp")
                if frame.width != info.width or frame.height != info.height:
                    raise SampleError(f"a frame of {frame.width}x{frame.height} in a "
                                      f"{info.width}x{info.height} stream (the size changes "
                                      "mid-stream)")
                if prev_pts is not None and pts <= prev_pts:
                    continue  # out of order or repeated: the frame shown is the one before
                while j < len(targets) and targets[j] < pts:
                    emit(j, prev if prev is not None else frame,
                         prev_pts if prev is not None else pts)
                    j += 1
                if j == len(targets):
                    return
                prev, prev_pts = frame, pts
        except av.FFmpegError as e:
            raise SampleError(f"cannot decode ({_reason(e)})") from e
        # the stream ended: its last frame is shown for one frame period
        while j < len(targets):
            if prev is None:
                raise SampleError("no frame could be decoded")
            if targets[j] >= prev_pts + period:
                end = float((prev_pts - info.start_pts) * info.time_base)
                want = float((targets[j] - info.start_pts) * info.time_base)
                raise SampleError(f"the clip runs past the video's end: a frame at {want:.3f}s, "
                                  f"the last frame is at {end:.3f}s (the header claims "
                                  f"{info.num_frames} frames at {float(info.fps):.3f} fps: a "
                                  "truncated file?)")
            emit(j, prev, prev_pts)
            j += 1


_reformatter: list = [None, None]  # (pid, VideoReformatter): this process's own


def to_rgb(frame: Any) -> np.ndarray:
    """``frame`` as an ``(H, W, 3)`` uint8 RGB view (rows may be padded), converted by FFmpeg
    (swscale, the decoder's own colour handling) on one thread with this process's own
    reformatter: PyAV's shared one keeps a threaded swscale context, and one made before a fork
    deadlocks the forked worker that uses it (seen with PyAV 18: the child hangs in
    ``to_ndarray``). The view lives as long as the returned array."""
    if _reformatter[0] != os.getpid():
        from av.video.reformatter import VideoReformatter
        _reformatter[:] = [os.getpid(), VideoReformatter()]
    rgb = _reformatter[1].reformat(frame, format="rgb24", threads=1)
    plane = rgb.planes[0]
    h, w = rgb.height, rgb.width
    rows = np.frombuffer(plane, np.uint8).reshape(h, plane.line_size)
    view = rows[:, :w * 3].reshape(h, w, 3)
    return view


def _check_info(container: Any, stream: Any) -> VideoInfo:
    cc = stream.codec_context
    if cc is None:
        # PyAV 18's streams have no codec_tag: without a decoder nothing names the codec
        tag = getattr(stream, "codec_tag", None) or "unknown"
        raise SampleError(f"no decoder for its video codec ({tag}): FFmpeg cannot decode it")
    w, h = int(cc.width or 0), int(cc.height or 0)
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE) or w * h > MAX_PIXELS:
        raise SampleError(f"a frame size of {w}x{h} in the header (at most {MAX_SIDE} a side "
                          f"and {MAX_PIXELS} pixels)")
    fps = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = Fraction(fps) if fps else Fraction(0)
    if not 0 < fps <= MAX_FPS:
        raise SampleError(f"a frame rate of {float(fps):.3f} fps in the header (0 to {MAX_FPS})")
    tb = Fraction(stream.time_base) if stream.time_base else Fraction(0)
    if tb <= 0:
        raise SampleError("no time base in the header")
    start = int(stream.start_time or 0)
    if stream.duration:
        duration = float(stream.duration * tb)
    elif container.duration:
        duration = container.duration / 1e6  # AV_TIME_BASE
    else:
        duration = 0.0
    if not 0 <= duration <= MAX_DURATION_S or not math.isfinite(duration):
        raise SampleError(f"a duration of {duration:.1f}s in the header (at most "
                          f"{MAX_DURATION_S}s)")
    frames = int(stream.frames or 0)
    if not 0 < frames <= duration * float(fps) * 1.5 + 2:  # no count, or one the duration belies
        frames = int(duration * float(fps))
    if frames <= 0:
        raise SampleError("no frames (a zero duration in the header)")
    return VideoInfo(w, h, fps, frames, tb, start, str(cc.name))


def _open(av: Any, file: Any, timeout_s: float, probe: bool) -> Any:
    """av.open under bounds. ``probe=False`` reads the container's headers alone: no packets
    read ahead and no frame decoded (``probesize``, ``skip_frame="all"``: 2.2 -> 0.3 ms an open
    of an MP4 here); MP4, WebM and Matroska say all we need there. Where FFmpeg decodes a frame
    to learn its size, ``max_pixels`` bounds it (a 16000x16000 SPS would cost 1.5 GB before
    our checks ran)."""
    options = dict(_BOUNDS)
    streams = None
    if not probe:
        options.update(probesize="32", analyzeduration="0", fpsprobesize="0")
        streams = [{"skip_frame": "all"}] * (MAX_STREAMS + 1)
    return av.open(file, mode="r", timeout=(timeout_s, timeout_s), metadata_errors="ignore",
                   options=options, stream_options=streams,
                   container_options={"max_streams": str(MAX_STREAMS + 1)})


def _described(stream: Any) -> bool:
    """The headers gave what a clip needs: a decoder, a frame size, a rate and a start time."""
    cc = stream.codec_context
    return cc is None or bool(cc.width and cc.height and stream.start_time is not None and (
        stream.average_rate or stream.guessed_rate or stream.base_rate))


def open_video(file: Any, *, threads: int = 1, timeout_s: float = 60.0) -> Video:
    """``file`` (a path or a binary file object) opened, its first video stream checked; raises
    ``SampleError`` saying what is wrong (the caller adds the file's name)."""
    av = _av()
    if hasattr(file, "seek"):
        if file.seek(0, os.SEEK_END) == 0:
            raise SampleError("an empty file (0 bytes)")
        file.seek(0)
    try:
        container = _open(av, file, timeout_s, probe=False)
        if not all(_described(s) for s in container.streams.video):
            container.close()  # a format whose headers alone do not say it: probe its packets
            if hasattr(file, "seek"):
                file.seek(0)
            container = _open(av, file, timeout_s, probe=True)
    except av.FFmpegError as e:
        # ENOMEM: past max_streams (each stream costs FFmpeg a decoder: ~0.7 MB for AAC)
        more = (f"; more than {MAX_STREAMS} streams?" if e.errno == errno.ENOMEM else "")
        raise SampleError(f"not a video FFmpeg can read ({_reason(e)}{more})") from e
    except (OSError, ValueError, UnicodeError) as e:
        raise SampleError(f"cannot open ({_reason(e)})") from e
    try:
        streams = container.streams
        if len(streams) > MAX_STREAMS:
            raise SampleError(f"more than {MAX_STREAMS} streams ({len(streams)} opened; at most "
                              f"{MAX_STREAMS} are read)")
        if not streams.video:
            kinds = sorted({s.type for s in streams}) or ["none"]
            raise SampleError(f"no video stream (streams: {', '.join(kinds)})")
        stream = streams.video[0]
        info = _check_info(container, stream)
        stream.codec_context.skip_frame = "DEFAULT"
        stream.codec_context.thread_count = max(1, int(threads))
        stream.codec_context.options = dict(_BOUNDS)  # a larger frame mid-stream, too
        return Video(container, stream, info)
    except BaseException:
        container.close()
        raise
