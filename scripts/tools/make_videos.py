"""Make a video dataset from scikit-image's photos: camera pans and zooms over each photo, encoded
with PyAV (H.264 in MP4, or VP9 in WebM), in class folders (Kinetics/UCF101 layout).

    python scripts/tools/make_videos.py DIR --n 64 [--classes 4] [--size 480x360] [--frames 150]

Nothing is downloaded: the photos ship with scikit-image. A video's motion, photo and length
follow from (seed, its number), so the same command makes the same files. ``write_video`` is
used by the tests (tests/test_video.py) to make their videos, hostile ones included.
"""
from __future__ import annotations

import argparse
import os
from fractions import Fraction

import numpy as np

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry")


def _photo(k: int) -> np.ndarray:
    import skimage.data
    return getattr(skimage.data, PHOTOS[k % len(PHOTOS)])()


def frames(n: int, width: int, height: int, seed: int = 0):
    """``n`` RGB frames (height, width, 3) of a pan and zoom over one photo, a frame counter
    burnt in at the top left (bright squares: frame k shows k's bits), so tests can read which
    frame they got."""
    import cv2
    rng = np.random.default_rng(seed)
    photo = _photo(int(rng.integers(len(PHOTOS))))
    big = cv2.resize(photo, (width * 2, height * 2), interpolation=cv2.INTER_AREA)
    dx, dy = rng.uniform(0.5, 2.0, 2)
    for k in range(n):
        x = int(k * dx) % width
        y = int(k * dy) % height
        frame = np.ascontiguousarray(big[y:y + height, x:x + width])
        for bit in range(10):  # 16x16 squares: survive H.264/VP9 at any quality used here
            frame[:16, bit * 16:(bit + 1) * 16] = 255 if (k >> bit) & 1 else 0
        yield frame


def frame_number(rgb: np.ndarray) -> int:
    """The counter ``frames`` burnt into a decoded (H, W, 3) frame."""
    return sum(1 << bit for bit in range(10) if rgb[4:12, bit * 16 + 4:bit * 16 + 12].mean() > 128)


def write_video(path: str, n: int = 60, width: int = 320, height: int = 240, fps: int = 30,
                codec: str = "libx264", gop: int = 16, seed: int = 0,
                pts: list[int] | None = None, options: dict | None = None) -> str:
    """Encode ``n`` frames to ``path`` (``.mp4`` with libx264, ``.webm`` with libvpx-vp9).
    ``pts``: each frame's timestamp in 1/fps units (a variable frame rate), else 0, 1, 2...
    ``options``: the muxer's (``{"movflags": "faststart"}``: an MP4's moov atom first)."""
    import av
    with av.open(path, "w", options=options) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": str(gop), "preset": "veryfast"} if codec == "libx264" else \
            {"g": str(gop), "deadline": "realtime", "cpu-used": "8"}
        stream.codec_context.time_base = Fraction(1, fps)
        for k, rgb in enumerate(frames(n, width, height, seed)):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = k if pts is None else pts[k]
            frame.time_base = Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def make_videos(root: str, n: int, classes: int = 4, width: int = 480, height: int = 360,
                frames_per_video: int = 150, seed: int = 0, webm_every: int = 0) -> list[str]:
    """``n`` videos in ``classes`` class folders under ``root``; every ``webm_every``-th one VP9
    in WebM (0: none). Returns the paths."""
    paths = []
    for i in range(n):
        folder = os.path.join(root, f"class_{i % classes:03d}")
        os.makedirs(folder, exist_ok=True)
        webm = webm_every and i % webm_every == webm_every - 1
        path = os.path.join(folder, f"video_{i:05d}.{'webm' if webm else 'mp4'}")
        if not os.path.exists(path):
            write_video(path, frames_per_video, width, height, codec="libvpx-vp9" if webm
                        else "libx264", gop=32, seed=seed * 100003 + i)
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--size", default="480x360", help="WIDTHxHEIGHT")
    p.add_argument("--frames", type=int, default=150, help="frames per video (30 fps)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    width, height = (int(v) for v in a.size.split("x"))
    paths = make_videos(a.root, a.n, a.classes, width, height, a.frames, a.seed)
    print(f"{len(paths)} videos in {a.root}")


if __name__ == "__main__":
    main()
