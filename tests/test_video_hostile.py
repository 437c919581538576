"""pooled_loader.video with hostile files (issue 49): every video a user has is untrusted.

Each bad input (cut, empty, lying headers, absurd sizes, thousands of streams, audio only, an
unknown codec, a clip longer than the video, random bytes, a slow decode, a link to /dev/zero, a
FIFO, broken shard members) raises ``SampleError`` naming the file and what is wrong; under
``on_error="skip"`` with worker processes it is a counted skip, never a crash or a hang; and
memory follows the clip, never the header's claims. Every file is made here, with PyAV and byte
edits of the good ones; nothing is downloaded."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import textwrap
from fractions import Fraction

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
pytest.importorskip("cv2")
pytest.importorskip("skimage")

import pooled_loader  # noqa: E402
from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.errors import SampleError  # noqa: E402
from pooled_loader.video import VideoClips, container  # noqa: E402
from pooled_loader.video.container import open_video  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
# child processes import the pooled_loader this process imported
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [os.path.dirname(os.path.dirname(os.path.abspath(pooled_loader.__file__)))]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
_spec = importlib.util.spec_from_file_location(
    "make_videos", os.path.join(ROOT, "scripts", "tools", "make_videos.py"))
mv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mv)

W, H, N, FPS = 160, 96, 48, 30  # the good videos: 48 frames at 30 fps, a keyframe every 8
SHAPE = (4, 3, H, W)

pytestmark = pytest.mark.timeout(120)


# -- making files --------------------------------------------------------------------------------
def write_faststart(path: str) -> str:
    """write_video's H.264 MP4 with the moov atom at the front (``movflags=faststart``)."""
    return mv.write_video(path, N, W, H, FPS, gop=8, options={"movflags": "faststart"})


def write_audio(path: str, codec: str, rate: int) -> str:
    """A few frames of silence, and no video stream."""
    with av.open(path, "w") as out:
        a = out.add_stream(codec, rate=rate)
        a.layout = "mono"
        fmt = a.codec_context.format.name
        n = a.codec_context.frame_size or 1024
        for k in range(5):
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, n), np.float32 if "flt" in fmt else np.int16), format=fmt,
                layout="mono")
            frame.sample_rate, frame.pts = rate, k * n
            for p in a.encode(frame):
                out.mux(p)
        for p in a.encode():
            out.mux(p)
    return path


def with_streams(src: str, path: str, n_audio: int) -> str:
    """``src``'s video packets plus ``n_audio`` tiny PCM audio streams (MKV, up to FFmpeg's
    1000-stream limit of a muxer)."""
    with av.open(src) as i, av.open(path, "w") as out:
        vs = i.streams.video[0]
        ov = out.add_stream_from_template(vs)
        auds = []
        for _ in range(n_audio):
            a = out.add_stream("pcm_s16le", rate=8000)
            a.layout = "mono"
            auds.append(a)
        for a in auds:
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 8), np.int16), format="s16",
                                               layout="mono")
            frame.sample_rate, frame.pts = 8000, 0
            for p in a.encode(frame):
                out.mux(p)
        for p in i.demux(vs):
            if p.dts is not None:
                p.stream = ov
                out.mux(p)
    return path


def boxes(data: bytes):
    """(type, whole box, offset) of the MP4 boxes at this level."""
    pos = 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        yield kind, data[pos:pos + size], pos
        pos += size


def with_traks(src: str, path: str, copies: int) -> str:
    """``src`` (an MP4 of a video and an audio track, moov at the end) with its audio ``trak``
    repeated ``copies`` more times in the moov, each with its own track ID."""
    data = open(src, "rb").read()
    top = list(boxes(data))
    moov = next(b for k, b, _ in top if k == b"moov")
    audio = [b for k, b, _ in boxes(moov[8:]) if k == b"trak"][1]

    def renumbered(tid: int) -> bytes:
        t = bytearray(audio)
        i = t.find(b"tkhd")
        t[i + 16:i + 20] = struct.pack(">I", tid)  # version 0: flags, 2 times, then the ID
        return bytes(t)
    body = moov[8:] + b"".join(renumbered(100 + k) for k in range(copies))
    new = struct.pack(">I4s", len(body) + 8, b"moov") + body
    with open(path, "wb") as f:
        f.write(b"".join(new if k == b"moov" else b for k, b, _ in top))
    return path


def patched(data: bytes, box: bytes, rel: int, fmt: str, value: int) -> bytes:
    """``data`` with the field ``rel`` bytes after the fourcc of the first ``box`` inside the
    moov (version-0 boxes) set to ``value``."""
    b = bytearray(data)
    i = b.find(box, b.find(b"moov")) + 4 + rel
    b[i:i + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(b)


# H.264's sequence parameter set, where the decoder (not the container) reads the frame size
def _rbsp(nal: bytes) -> bytes:
    out, zeros = bytearray(), 0
    for b in nal:
        if zeros >= 2 and b == 3:
            zeros = 0
            continue
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


def _ebsp(raw: bytes) -> bytes:
    out, zeros = bytearray(), 0
    for b in raw:
        if zeros >= 2 and b <= 3:
            out.append(3)
            zeros = 0
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


def _ue(v: int) -> str:
    b = f"{v + 1:b}"
    return "0" * (len(b) - 1) + b


def sps_claiming(nal: bytes, width: int, height: int) -> bytes:
    """The SPS NAL unit ``nal`` (x264's: no scaling lists, poc type 0 or 2) with its frame size
    set to ``width`` x ``height`` (multiples of 16)."""
    bits = "".join(f"{b:08b}" for b in _rbsp(nal[1:]))
    pos = 0

    def u(n: int) -> int:
        nonlocal pos
        pos += n
        return int(bits[pos - n:pos], 2)

    def ue() -> int:
        nonlocal pos
        zeros = 0
        while bits[pos] == "0":
            zeros, pos = zeros + 1, pos + 1
        return u(zeros + 1) - 1
    profile = u(8)
    u(16), ue()
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        if ue() == 3:
            u(1)
        ue(), ue(), u(1)
        assert u(1) == 0, "an SPS with scaling lists"
    ue()
    poc = ue()
    assert poc in (0, 2), f"pic_order_cnt_type {poc}"
    if poc == 0:
        ue()
    ue(), u(1)
    head = bits[:pos]
    ue(), ue()
    new = head + _ue(width // 16 - 1) + _ue(height // 16 - 1) + bits[pos:].rstrip("0")
    new += "0" * (-len(new) % 8)
    return nal[:1] + _ebsp(bytes(int(new[i:i + 8], 2) for i in range(0, len(new), 8)))


_PARENTS = {b"moov": 0, b"trak": 0, b"mdia": 0, b"minf": 0, b"stbl": 0, b"stsd": 8, b"avc1": 78}


def with_sps_size(data: bytes, width: int, height: int) -> bytes:
    """An MP4 (moov at the end) whose avcC SPS claims ``width`` x ``height``; the sizes of the
    boxes around it follow."""
    out = bytearray()
    for kind, box, _ in boxes(data):
        body = box[8:]
        if kind in _PARENTS:
            skip = _PARENTS[kind]
            body = body[:skip] + with_sps_size(body[skip:], width, height)
        elif kind == b"avcC":
            n = struct.unpack(">H", body[6:8])[0]
            sps = sps_claiming(body[8:8 + n], width, height)
            body = body[:6] + struct.pack(">H", len(sps)) + sps + body[8 + n:]
        out += struct.pack(">I4s", len(body) + 8, kind) + body
    return bytes(out)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The good videos, made once: H.264/MP4 (moov at the end, FFmpeg's default), the same with
    the moov at the front, VP9/WebM, and an MP4 with an AAC track besides the video."""
    d = str(tmp_path_factory.mktemp("hostile_base"))
    paths = {"mp4": mv.write_video(os.path.join(d, "good.mp4"), N, W, H, gop=8),
             "webm": mv.write_video(os.path.join(d, "good.webm"), N, W, H, codec="libvpx-vp9",
                                    gop=8),
             "fast": write_faststart(os.path.join(d, "fast.mp4"))}
    path = os.path.join(d, "with_audio.mp4")
    with av.open(paths["mp4"]) as i, av.open(path, "w") as out:
        vs = i.streams.video[0]
        ov = out.add_stream_from_template(vs)
        a = out.add_stream("aac", rate=8000)
        a.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate, frame.pts = 8000, 0
        for p in list(a.encode(frame)) + list(a.encode()):
            out.mux(p)
        for p in i.demux(vs):
            if p.dts is not None:
                p.stream = ov
                out.mux(p)
    paths["with_audio"] = path
    paths["dir"] = d
    return paths


def put(directory, name: str, data: bytes) -> str:
    path = os.path.join(str(directory), name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def refused(path: str, *what: str, **kwargs) -> str:
    """``VideoClips([path])[i]`` raises SampleError for every clip, naming the file and each of
    ``what``; returns the first message."""
    kwargs.setdefault("frames_per_clip", 4)
    ds = VideoClips([path], **kwargs)
    messages = []
    for i in range(len(ds)):
        with pytest.raises(SampleError) as info:
            ds[i]
        text = str(info.value)
        assert text.startswith(f"{path}: "), text
        for w in what:
            assert w in text, text
        messages.append(text)
    return messages[0]


def numbers(clip: torch.Tensor) -> list[int]:
    return [mv.frame_number(np.ascontiguousarray(f.permute(1, 2, 0).numpy())) for f in clip]


def assert_frames_match_times(clip: torch.Tensor, stamps) -> None:
    """A 30 fps clip of the good videos: each frame is the one its timestamp names."""
    assert numbers(clip) == [round(float(t) * FPS) for t in stamps]


# -- 1-3: cut files, an empty file, the moov at either end ---------------------------------------
@pytest.mark.parametrize("cut", [0.5, 0.9, 1000])
def test_a_cut_mp4_has_no_moov_and_is_named(base, tmp_path, cut):
    data = read(base["mp4"])
    assert data.find(b"moov") > len(data) * 0.9  # FFmpeg's mp4 muxer writes it last
    n = cut if isinstance(cut, int) else int(len(data) * cut)
    path = put(tmp_path, "cut.mp4", data[:n])
    refused(path, "not a video FFmpeg can read")


def test_a_cut_webm_is_refused(base, tmp_path):
    data = read(base["webm"])
    for n in (1000, len(data) // 10):
        path = put(tmp_path, f"cut{n}.webm", data[:n])
        refused(path, sampler="uniform", clips_per_video=3)


def test_an_empty_file_is_named(tmp_path):
    for name in ("empty.mp4", "empty.webm", "empty.mkv"):
        refused(put(tmp_path, name, b""), "an empty file (0 bytes)")


def test_moov_at_the_end_or_the_front_reads_normally(base):
    for key in ("mp4", "fast"):
        data = read(base[key])
        front = data.find(b"moov") < data.find(b"mdat")
        assert front == (key == "fast")
        ds = VideoClips([base[key]], frames_per_clip=4, frame_step=3, clips_per_video=3,
                        sampler="uniform", return_timestamps=True)
        for i in range(3):
            clip, label, stamps = ds[i]
            assert clip.shape == SHAPE and clip.dtype == torch.uint8 and label == -1
            assert numbers(clip) == [round(float(t) * FPS) for t in stamps]
            assert np.allclose(np.diff(stamps), 3 / FPS)


def test_a_faststart_mp4_cut_in_its_media_data(base, tmp_path):
    """The moov is whole, the media data ends at the keyframe of frame 24: clips before the
    cut are the right frames, clips past it raise (the stream ends, or a packet is cut)."""
    data = read(base["fast"])
    with av.open(base["fast"]) as c:
        s = c.streams.video[0]
        tb = s.time_base
        keys = sorted((p.pts, p.pos) for p in c.demux(s) if p.is_keyframe and p.pts is not None)
    pos = next(pos for pts, pos in keys if pts * tb >= Fraction(24, FPS))
    path = put(tmp_path, "fastcut.mp4", data[:pos])
    ds = VideoClips([path], frames_per_clip=4, clips_per_video=12, sampler="uniform",
                    return_timestamps=True)
    for i in range(4):  # clips starting at frames 1, 5, 9, 13
        clip, _, stamps = ds[i]
        assert clip.shape == SHAPE
        assert_frames_match_times(clip, stamps)
    for i in range(7, 12):  # frames 28 to 46: past the cut
        with pytest.raises(SampleError) as info:
            ds[i]
        assert str(info.value).startswith(f"{path}: ")


# -- 4: absurd frame sizes -----------------------------------------------------------------------
def test_a_lying_tkhd_or_stsd_size_is_overruled_by_the_decoders_own(base, tmp_path):
    """The container's width and height (tkhd, the avc1 sample entry) say 60000x60000; FFmpeg
    takes the size from the H.264 SPS, so the clip is the real one."""
    data = bytearray(read(base["mp4"]))
    a = data.find(b"avc1", data.find(b"moov"))
    assert struct.unpack(">HH", data[a + 28:a + 32]) == (W, H)
    data[a + 28:a + 32] = struct.pack(">HH", 60000, 60000)
    t = data.find(b"tkhd") + 4 + 76  # version 0: the 16.16 width and height
    assert struct.unpack(">II", data[t:t + 8]) == (W << 16, H << 16)
    data[t:t + 8] = struct.pack(">II", 60000 << 16, 60000 << 16)
    path = put(tmp_path, "tkhd.mp4", bytes(data))
    ds = VideoClips([path], frames_per_clip=4, return_timestamps=True)
    clip, _, stamps = ds[0]
    assert clip.shape == SHAPE
    assert_frames_match_times(clip, stamps)


def test_an_sps_size_above_the_limits_is_refused_before_decoding(base, tmp_path):
    data = read(base["mp4"])
    assert with_sps_size(data, W, H) == data  # the rewriter changes nothing else
    path = put(tmp_path, "sps16000.mp4", with_sps_size(data, 16000, 16000))
    with av.open(path) as c:  # FFmpeg does report the SPS's size
        cc = c.streams.video[0].codec_context
        assert (cc.width, cc.height) == (16000, 16000)
    # the open reads the container's size without decoding (a fast probe); the decoder, bounded
    # by max_pixels, then refuses the SPS's
    text = refused(path)
    assert "a frame size of 16000x16000" in text or "cannot decode" in text, text
    path = put(tmp_path, "sps60000.mp4", with_sps_size(data, 60000, 60000))
    refused(path)  # past FFmpeg's own limit: its decoder refuses


def test_a_y4m_header_alone_claiming_a_huge_frame(tmp_path):
    path = put(tmp_path, "huge.mkv", b"YUV4MPEG2 W60000 H60000 F30:1 C420jpeg\nFRAME\n"
               + bytes(1000))  # content, not the name, picks the demuxer
    refused(path, "not a video FFmpeg can read")
    path = put(tmp_path, "big.mkv", b"YUV4MPEG2 W8000 H8000 F30:1 C420jpeg\nFRAME\n"
               + bytes(1000))
    assert 8000 * 8000 > container.MAX_PIXELS
    refused(path, "a frame size of 8000x8000 in the header")


MEMORY = textwrap.dedent("""
    import json, sys
    from pooled_loader.errors import SampleError
    from pooled_loader.video import VideoClips

    def peak_kb():  # this process's own peak (ru_maxrss after exec can be the parent's)
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    VideoClips([sys.argv[1]], frames_per_clip=4)[0]  # warm: imports, FFmpeg's tables
    rss0 = peak_kb()
    for path in sys.argv[2:]:
        try:
            VideoClips([path], frames_per_clip=4)[0]
            error = None
        except SampleError as e:
            error = str(e)
        grown = (peak_kb() - rss0) / 1024
        print(json.dumps({"path": path, "error": error, "grown_mb": grown}), flush=True)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM")
def test_memory_follows_the_clip_not_the_headers_claims(base, tmp_path):
    """In a fresh process: a 16000x16000 SPS (FFmpeg's probe, run before any header can be
    checked, allocated 0.7 GB for it before its decoders were given max_pixels), a 60000x60000
    Y4M header, an MP4 of 1000 AAC streams (0.7 GB of decoders before FFmpeg was given
    max_streams) are refused; a frame count of 2^31 - 1 is not believed; and the process's
    peak memory grows by less than 300 MB over them all."""
    data = read(base["mp4"])
    hostile = [put(tmp_path, "sps.mp4", with_sps_size(data, 16000, 16000)),
               put(tmp_path, "y4m.mp4", b"YUV4MPEG2 W60000 H60000 F30:1\nFRAME\n" + bytes(99)),
               with_traks(base["with_audio"], str(tmp_path / "traks998.mp4"), 998),
               put(tmp_path, "stts.mp4", patched(data, b"stts", 8, ">I", 0x7FFFFFFF))]
    r = subprocess.run([sys.executable, "-c", MEMORY, base["mp4"], *hostile],
                       capture_output=True, text=True, timeout=90, cwd=tmp_path, env=CHILD_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["path"] for row in rows] == hostile
    for row in rows[:3]:
        assert row["error"] and row["error"].startswith(row["path"]), row
    assert rows[-1]["error"] is None  # the count is belied by the duration: the clip is real
    assert rows[-1]["grown_mb"] < 300, rows


# -- 5: lying frame counts and durations ---------------------------------------------------------
def test_a_webm_duration_ten_times_too_long_places_clips_past_the_end(base, tmp_path):
    data = bytearray(read(base["webm"]))
    i = data.find(b"\x44\x89")  # Segment Info's Duration: an 8-byte float, in milliseconds
    assert data[i + 2] == 0x88 and struct.unpack(">d", data[i + 3:i + 11])[0] == 1600.0
    data[i + 3:i + 11] = struct.pack(">d", 16000.0)
    path = put(tmp_path, "long.webm", bytes(data))
    with open(path, "rb") as f, open_video(f) as v:
        assert v.info.num_frames == 480
    # uniform: 4 clips at the centres of 4 segments of the claimed 480 frames, all past 48
    refused(path, "the clip runs past the video's end", "480 frames",
            sampler="uniform", clips_per_video=4)
    for ms, what in [(7 * 24 * 3600 * 1000.0 + 1e6, "a duration of"), (-5.0, "a duration of"),
                     (float("nan"), "no frames"), (float("inf"), "no frames")]:
        data[i + 3:i + 11] = struct.pack(">d", ms)
        refused(put(tmp_path, "lie.webm", bytes(data)), what)


def test_mp4_frame_counts_and_durations_that_lie(base, tmp_path):
    """FFmpeg's mov demuxer keeps the smallest of the mdhd and stts durations and indexes the
    samples stsz lists, so a huge mvhd/mdhd duration or stts count does not move the clips: they
    are still the real frames (and a count the duration belies is not believed). Both at the
    maximum overflow FFmpeg's sum to a zero duration: refused."""
    data = read(base["mp4"])
    lies = {"mvhd": patched(data, b"mvhd", 16, ">I", 0x7FFFFFFF),
            "mdhd": patched(data, b"mdhd", 16, ">I", 0x7FFFFFFF),
            "stts": patched(data, b"stts", 8, ">I", 0x7FFFFFFF),
            "both": patched(patched(data, b"stts", 8, ">I", 480), b"mdhd", 16, ">I", 245760)}
    for name, lie in lies.items():
        path = put(tmp_path, f"{name}.mp4", lie)
        ds = VideoClips([path], frames_per_clip=4, sampler="uniform", clips_per_video=5,
                        return_timestamps=True)
        for i in range(len(ds)):
            clip, _, stamps = ds[i]
            assert clip.shape == SHAPE, name
            assert_frames_match_times(clip, stamps)
    worst = patched(patched(data, b"stts", 8, ">I", 0x7FFFFFFF), b"mdhd", 16, ">I", 0xFFFFFFFF)
    refused(put(tmp_path, "worst.mp4", worst), "no frames")


# -- 6: streams ----------------------------------------------------------------------------------
def test_thousands_of_streams_are_refused_by_count(base, tmp_path):
    ok = with_streams(base["mp4"], str(tmp_path / "s63.mkv"), container.MAX_STREAMS - 1)
    assert VideoClips([ok], frames_per_clip=4)[0][0].shape == SHAPE
    for n in (container.MAX_STREAMS, 999):  # 1000 streams: a muxer's most
        path = with_streams(base["mp4"], str(tmp_path / f"s{n}.mkv"), n)
        refused(path, f"more than {container.MAX_STREAMS} streams")
    for copies in (100, 2000):  # MP4 tracks: FFmpeg stops at the limit it is given
        path = with_traks(base["with_audio"], str(tmp_path / f"t{copies}.mp4"), copies)
        refused(path, f"more than {container.MAX_STREAMS} streams")
    with_audio = VideoClips([base["with_audio"]], frames_per_clip=4, return_timestamps=True)
    clip, _, stamps = with_audio[0]
    assert_frames_match_times(clip, stamps)


def test_audio_only_files_have_no_video_stream(tmp_path):
    for name, codec, rate in [("a.mp4", "aac", 8000), ("a.webm", "libopus", 48000),
                              ("a.mkv", "mp2", 16000)]:
        path = write_audio(str(tmp_path / name), codec, rate)
        refused(path, "no video stream (streams: audio)")


# -- 7: variable frame rate ----------------------------------------------------------------------
DELTAS = [1, 1, 1, 4, 1, 1, 2, 1, 1, 1, 7, 1, 1, 1, 1, 3]  # bursts and gaps, in 1/30 s


def expected_targets(info, t, k, cpv, *, step=None, fps=None):
    """The times (stream time base) VideoClips shows for clip ``k`` of ``cpv`` uniform clips:
    the segment's centre on the header's frame grid, plus half a frame (dataset._targets)."""
    if fps is None:
        span, offsets = (t - 1) * step + 1, [Fraction(j * step) / info.fps for j in range(t)]
    else:
        fps = Fraction(fps).limit_denominator(1001)
        span, offsets = int((t - 1) * info.fps / fps) + 1, [Fraction(j) / fps for j in range(t)]
    first = (2 * k + 1) * (info.num_frames - span + 1) // (2 * cpv)
    start = (Fraction(first) + Fraction(1, 2)) / info.fps
    return [info.start_pts + int((start + o) / info.time_base) for o in offsets]


@pytest.mark.parametrize("ext,codec", [("mp4", "libx264"), ("webm", "libvpx-vp9")])
def test_variable_frame_rate_takes_the_frame_shown_at_each_time(tmp_path, ext, codec):
    pts = np.cumsum([0] + [DELTAS[k % len(DELTAS)] for k in range(N - 1)]).tolist()
    path = mv.write_video(str(tmp_path / f"vfr.{ext}"), N, W, H, codec=codec, gop=8, pts=pts)
    with av.open(path) as c:
        s = c.streams.video[0]
        shown = [(f.pts, mv.frame_number(f.to_ndarray(format="rgb24"))) for f in c.decode(s)]
    assert [n for _, n in shown] == list(range(N))  # decode order put back to display order
    with open(path, "rb") as f, open_video(f) as v:
        info = v.info
    for kw in (dict(fps=10), dict(fps=45), dict(fps=30), dict(frame_step=3)):
        cpv, t = 4, 6
        ds = VideoClips([path], frames_per_clip=t, clips_per_video=cpv, sampler="uniform",
                        return_timestamps=True, **kw)
        for k in range(cpv):
            clip, _, stamps = ds[k]
            assert clip.shape == (t, 3, H, W)
            targets = expected_targets(info, t, k, cpv, step=kw.get("frame_step"),
                                       fps=kw.get("fps"))
            want = [max((p, n) for p, n in shown if p <= target) for target in targets]
            assert numbers(clip) == [n for _, n in want], (kw, k)
            assert np.allclose(stamps, [float(p * info.time_base) for p, _ in want])


# -- 9, 10: an unknown codec, a clip longer than the video ---------------------------------------
def test_an_unknown_codec_is_named(base, tmp_path):
    data = bytearray(read(base["mp4"]))
    a = data.find(b"avc1", data.find(b"moov"))
    data[a:a + 4] = b"zzzz"
    refused(put(tmp_path, "zzzz.mp4", bytes(data)), "no decoder for its video codec")


def test_a_clip_longer_than_the_video_names_both_counts(base):
    for path in (base["mp4"], base["webm"]):
        refused(path, "a clip of 49 frames spans 49 frames", "which has 48",
                frames_per_clip=49)
        refused(path, "a clip of 4 frames spans 49 frames", "which has 48",
                frames_per_clip=4, frame_step=16)
    assert VideoClips([base["mp4"]], frames_per_clip=48)[0][0].shape == (N, 3, H, W)


# -- 11: random bytes ----------------------------------------------------------------------------
FUZZ = textwrap.dedent("""
    import faulthandler, random, struct, sys
    from pooled_loader.errors import SampleError
    from pooled_loader.video import VideoClips
    EXTREMES = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    out_dir, n = sys.argv[1], int(sys.argv[2])
    for src in sys.argv[3:]:
        data = open(src, "rb").read()
        ext = src.rsplit(".", 1)[1]
        lo = data.find(b"moov") - 4 if ext == "mp4" else 0  # the header: flips there matter
        hi = len(data) if ext == "mp4" else 600
        rng = random.Random(src[-4:])
        for k in range(n):
            b = bytearray(data)
            if k % 4 == 0:  # bits anywhere
                for _ in range(rng.randint(1, 20)):
                    i = rng.randrange(len(b)); b[i] ^= 1 << rng.randrange(8)
            elif k % 4 == 1:  # a random range anywhere
                i = rng.randrange(len(b)); m = min(rng.randint(1, 512), len(b) - i)
                b[i:i + m] = rng.randbytes(m)
            elif k % 4 == 2:  # bits in the header
                for _ in range(rng.randint(1, 8)):
                    i = rng.randrange(lo, hi); b[i] ^= 1 << rng.randrange(8)
            else:  # sizes and counts in the header set to extremes
                for _ in range(rng.randint(1, 3)):
                    i = rng.randrange(lo, hi - 4)
                    b[i:i + 4] = struct.pack(">I", rng.choice(EXTREMES))
            path = f"{out_dir}/{k}.{ext}"
            open(path, "wb").write(b)
            print("START", path, flush=True)
            faulthandler.dump_traceback_later(20, exit=True)  # a hang is a failure, named
            ds = VideoClips([path], frames_per_clip=4, frame_step=2, clips_per_video=2,
                            sampler="uniform", decode_timeout_s=10)
            for i in range(2):
                try:
                    clip = ds[i][0]
                    ok = (clip.ndim == 4 and tuple(clip.shape[:2]) == (4, 3)
                          and str(clip.dtype) == "torch.uint8")
                    print("OK" if ok else f"BAD SHAPE {tuple(clip.shape)}", path, flush=True)
                except SampleError as e:
                    print("SAMPLEERROR", path, "named" if str(e).startswith(path) else
                          f"UNNAMED {e}", flush=True)
                except Exception as e:
                    print("OTHER", path, type(e).__name__, e, flush=True)
            faulthandler.cancel_dump_traceback_later()
    print("DONE", flush=True)
""")


def test_random_bytes_decode_or_raise_sample_error_never_crash(base, tmp_path):
    """30 seeded variants each of a good MP4 and WebM (flipped bits, random ranges, header
    fields set to extremes), in a child process so that a crash or a hang fails this test with
    the file that caused it: every clip decodes to (4, 3, H, W) uint8 or raises SampleError
    naming the file."""
    r = subprocess.run([sys.executable, "-c", FUZZ, str(tmp_path), "30", base["mp4"],
                        base["webm"]], capture_output=True, text=True, timeout=100,
                       cwd=tmp_path, env=CHILD_ENV)
    lines = r.stdout.splitlines()
    last = next((ln for ln in reversed(lines) if ln.startswith("START")), "before any case")
    assert r.returncode == 0 and lines[-1:] == ["DONE"], \
        f"the child died (rc {r.returncode}) at {last}:\n{r.stderr[-3000:]}"
    results = [ln for ln in lines if not ln.startswith(("START", "DONE"))]
    assert len(results) == 2 * 30 * 2
    bad = [ln for ln in results if not (ln.startswith("OK") or
                                       (ln.startswith("SAMPLEERROR") and ln.endswith("named")))]
    assert not bad, bad
    assert sum(ln.startswith("SAMPLEERROR") for ln in results) >= 10  # the fuzz does bite


# -- 12: a deadline ------------------------------------------------------------------------------
def test_a_decode_deadline_is_checked_per_frame(base):
    for path in (base["mp4"], base["webm"]):
        refused(path, "longer than the deadline", decode_timeout_s=1e-4, frames_per_clip=8)


# -- 13: links to devices, FIFOs, folders named as videos ----------------------------------------
@pytest.mark.timeout(30)
def test_a_link_to_dev_zero_a_fifo_and_a_folder_in_a_class_folder(base, tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    shutil.copy(base["mp4"], root / "a" / "good.mp4")
    os.symlink("/dev/zero", root / "a" / "zero.mp4")
    os.mkfifo(root / "a" / "fifo.webm")  # opened as a reader would block forever
    os.symlink(base["mp4"], root / "a" / "link.mp4")  # a link to a real video is followed
    ds = VideoClips(str(root), frames_per_clip=4)
    names = [os.path.basename(ds.table.name(i)) for i in range(len(ds))]
    assert names == ["fifo.webm", "good.mp4", "link.mp4", "zero.mp4"]
    refused_at = {"fifo.webm": "a FIFO", "zero.mp4": "a character device"}
    for i, name in enumerate(names):
        if name in refused_at:
            with pytest.raises(SampleError) as info:
                ds[i]
            text = str(info.value)
            assert text.startswith(ds.table.name(i)) and refused_at[name] in text, text
            assert "not a regular file" in text
        else:
            assert ds[i][0].shape == SHAPE
    os.mkdir(tmp_path / "dir.mp4")
    refused(str(tmp_path / "dir.mp4"), "a directory")
    refused(str(tmp_path / "missing.mp4"), "FileNotFoundError")


# -- 14: WebDataset shards -----------------------------------------------------------------------
def tar_of(path: str, members) -> str:
    with tarfile.open(path, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_shard_members_cut_or_missing_are_named_shard_and_key(base, tmp_path):
    mp4, webm = read(base["mp4"]), read(base["webm"])
    shard = tar_of(str(tmp_path / "s.tar"), [
        ("a.mp4", mp4), ("a.cls", b"1"),
        ("b.mp4", mp4[:len(mp4) // 2]), ("b.cls", b"2"),  # cut: no moov
        ("c.webm", webm[:3000]), ("c.cls", b"0"),  # cut: the clusters
        ("d.mp4", b""),
        ("e.webm", webm)])
    ds = VideoClips(shard, frames_per_clip=4, return_timestamps=True)
    assert len(ds) == 5
    for i, key in enumerate("abcde"):
        if key in "ae":
            clip, label, stamps = ds[i]
            assert clip.shape == SHAPE and label == (1 if key == "a" else -1)
            assert_frames_match_times(clip, stamps)
        else:
            with pytest.raises(SampleError) as info:
                ds[i]
            assert str(info.value).startswith(f"{shard}:{key}: "), str(info.value)
    no_video = tar_of(str(tmp_path / "nv.tar"), [("a.mp4", mp4), ("b.cls", b"2"),
                                                 ("c.mp4", mp4)])
    with pytest.raises(SampleError, match=f"{no_video}:b: no video member"):
        VideoClips(no_video, frames_per_clip=4)
    bad_cls = tar_of(str(tmp_path / "bc.tar"), [("a.mp4", mp4), ("a.cls", b"x1")])
    with pytest.raises(SampleError, match=f"{bad_cls}:a: .cls is not a class index"):
        VideoClips(bad_cls, frames_per_clip=4)
    two = tar_of(str(tmp_path / "two.tar"), [("a.mp4", mp4), ("a.webm", webm)])
    with pytest.raises(SampleError, match=f"{two}:a: two video members"):
        VideoClips(two, frames_per_clip=4)
    data = read(shard)
    cut = put(tmp_path, "cut.tar", data[:len(data) // 3])
    with pytest.raises(SampleError, match="truncated shard"):
        VideoClips(cut, frames_per_clip=4)


# -- the loader: a mixed folder, skipped and counted ---------------------------------------------
class Counted(VideoClips):
    """VideoClips that appends the name of every clip that fails to ``log`` (one line each,
    O_APPEND: the workers' writes do not mix), so the test knows every failed load."""

    def __init__(self, *args, log: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def getitem_into(self, index, out):
        try:
            return super().getitem_into(index, out)
        except SampleError:
            with open(self.log, "a") as f:
                f.write(self.table.name(index // self.clips_per_video) + "\n")
            raise


@pytest.mark.timeout(60)
def test_skip_with_2_workers_over_good_and_bad_files(base, tmp_path, caplog):
    root = tmp_path / "root"
    for c in ("c0", "c1"):
        (root / c).mkdir(parents=True)
    mp4, webm = read(base["mp4"]), read(base["webm"])
    for k in range(10):
        put(root / f"c{k % 2}", f"good{k}.mp4", mp4)
    put(root / "c1", "good.webm", webm)
    bad = [put(root / "c0", "empty.mp4", b""),
           put(root / "c1", "cut.mp4", mp4[:5000]),
           put(root / "c0", "cut.webm", webm[:2000]),
           put(root / "c1", "zzzz.mp4", mp4[:mp4.find(b"avc1", mp4.find(b"moov"))] + b"zzzz"
               + mp4[mp4.find(b"avc1", mp4.find(b"moov")) + 4:]),
           put(root / "c0", "huge.mp4", with_sps_size(mp4, 16000, 16000)),
           write_audio(str(root / "c1" / "audio.mp4"), "aac", 8000),
           with_streams(base["mp4"], str(root / "c0" / "streams.mkv"), 200)]
    os.symlink("/dev/zero", root / "c1" / "zero.mp4")
    os.mkfifo(root / "c0" / "fifo.mp4")
    bad += [str(root / "c1" / "zero.mp4"), str(root / "c0" / "fifo.mp4")]
    log = str(tmp_path / "failed.txt")
    ds = Counted(str(root), frames_per_clip=4, frame_step=2, log=log)
    assert len(ds) == 11 + len(bad) == 20
    loader = PooledLoader(ds, batch_size=4, num_workers=2, on_error="skip", timeout=60)
    for epoch in range(2):
        n = 0
        for clips, labels in loader:
            assert clips.shape == (4,) + SHAPE and clips.dtype == torch.uint8
            assert labels.shape == (4,) and set(labels.tolist()) <= {0, 1}
            n += 1
        assert n == 5
        with open(log) as f:
            failed = f.read().splitlines()
        assert set(failed) == set(bad)  # every bad file hit, no good one failed
        assert loader.stats()["skipped"] == len(failed)  # replacements that failed count too
    logged = " ".join(r.getMessage() for r in caplog.records if "skipped sample" in
                      r.getMessage())
    for path in bad:
        assert path in logged
