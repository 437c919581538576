"""pooled_loader.cache: round trip, resume after SIGKILL, atomic visibility, bad input, variants."""
from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from pooled_loader.cache import (
    CachedDataset, CacheError, CacheFormatError, CacheIncompleteError, CacheMismatchError,
    CacheSampleError,
    build_cache, dataset_fingerprint, main, partial_progress, variant_for_epoch,
)
from pooled_loader.__main__ import main as cli
from pooled_loader.cache.format import FORMAT_VERSION
from pooled_loader.core.errors import SampleError

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- a small JPEG image folder and stand-in transforms (t(x, out=None)) ----------------------

class Decode:
    def __call__(self, x, out=None):
        import simplejpeg
        return simplejpeg.decode_jpeg(x, colorspace="RGB")

    def __repr__(self):
        return "Decode()"


class ResizeMax:
    def __init__(self, n):
        self.n = n

    def __call__(self, x, out=None):
        import cv2
        h, w = x.shape[:2]
        s = self.n / max(h, w)
        if s >= 1:
            return x
        return cv2.resize(x, (max(1, round(w * s)), max(1, round(h * s))),
                          interpolation=cv2.INTER_AREA)

    def __repr__(self):
        return f"ResizeMax({self.n})"


class RandomCropFlipCHW:
    """Random s x s crop (np.random), random flip, HWC -> CHW, written into ``out``."""

    def __init__(self, s):
        self.s = s

    def __call__(self, x, out=None):
        s = self.s
        y0 = np.random.randint(0, x.shape[0] - s + 1)
        x0 = np.random.randint(0, x.shape[1] - s + 1)
        crop = x[y0:y0 + s, x0:x0 + s]
        if np.random.rand() < 0.5:
            crop = crop[:, ::-1]
        if out is None:
            out = np.empty((3, s, s), np.uint8)
        np.copyto(out, crop.transpose(2, 0, 1))
        return out

    def __repr__(self):
        return f"RandomCropFlipCHW({self.s})"


class Chain:
    def __init__(self, ops):
        self.ops = ops

    def __call__(self, x, out=None):
        for op in self.ops[:-1]:
            x = op(x)
        return self.ops[-1](x, out=out)

    def __repr__(self):
        return f"Chain({self.ops!r})"


class JpegFolder:
    """ImageFolder stand-in: ``samples`` = [(path, class index)], yields (image, label)."""

    def __init__(self, root, transform=None, delay=0.0):
        classes = sorted(os.listdir(root))
        self.samples = [(os.path.join(root, c, f), ci) for ci, c in enumerate(classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]
        self.transform, self.delay, self.calls = transform, delay, 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        p, label = self.samples[i]
        with open(p, "rb") as f:
            data = f.read()
        return (self.transform(data) if self.transform else data), label


def make_jpegs(root, n=24, classes=3, seed=0):
    """Real JPEG files of varied size and aspect ratio."""
    import cv2
    rng = np.random.default_rng(seed)
    for i in range(n):
        d = os.path.join(root, f"class_{i % classes}")
        os.makedirs(d, exist_ok=True)
        h, w = (int(v) for v in rng.integers(40, 120, 2))
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(xx * 3 + i * 7) % 256, (yy * 2) % 256,
                        rng.integers(0, 256, (h, w))], -1).astype(np.uint8)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        assert ok
        with open(os.path.join(d, f"img_{i:03d}.jpg"), "wb") as f:
            f.write(buf.tobytes())
    return root


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    return make_jpegs(str(tmp_path_factory.mktemp("jpegs")))


def front(root, **kw):
    return JpegFolder(root, transform=Chain([Decode(), ResizeMax(64)]), **kw)


@pytest.fixture(scope="module")
def built(jpeg_root, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cache") / "front.plc")
    build_cache(front(jpeg_root), path, num_workers=2, progress=False)
    return path


def records(path):
    ds = CachedDataset(path)
    return [[np.array(v) if isinstance(v, np.ndarray) else v for v in ds.raw(i, k)]
            for i in range(len(ds)) for k in range(ds.variants)]


# ---- round trip -------------------------------------------------------------------------------

def test_round_trip_matches_source_pipeline(jpeg_root, built):
    src = front(jpeg_root)
    ds = CachedDataset(built, expect_fingerprint_of=src)
    assert len(ds) == len(src)
    shapes = set()
    for i in range(len(src)):
        img, label = ds[i]
        ref, ref_label = src[i]
        assert label == ref_label and type(label) is int
        assert img.shape == ref.shape and np.array_equal(img, ref)
        assert not img.flags.writeable and not img.flags.owndata  # a view of the file
        shapes.add(img.shape)
    assert len(shapes) > 5  # records keep their own shape and aspect
    ds.verify(src)
    assert not os.path.exists(built + ".partial")
    assert not os.path.exists(built + ".partial.journal")


def test_getitem_into_writes_into_out(built):
    ds = CachedDataset(built, transform=RandomCropFlipCHW(24))
    out = (np.zeros((3, 24, 24), np.uint8), None)
    for i in range(len(ds)):
        np.random.seed(i)
        img, label = ds.getitem_into(i, out)
        assert img is out[0]
        np.random.seed(i)
        ref, ref_label = ds[i]
        assert np.array_equal(img, ref) and label == ref_label


def test_build_is_a_noop_when_complete_and_refuses_another_dataset(jpeg_root, built, tmp_path):
    before = os.stat(built).st_mtime_ns
    assert build_cache(front(jpeg_root), built, num_workers=0, progress=False) == built
    assert os.stat(built).st_mtime_ns == before
    other = JpegFolder(jpeg_root, transform=Chain([Decode(), ResizeMax(32)]))
    with pytest.raises(CacheMismatchError, match="overwrite=True"):
        build_cache(other, built, progress=False)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_workers_fork_and_spawn(jpeg_root, built, ctx, tmp_path):
    path = str(tmp_path / f"{ctx}.plc")  # building under this start method gives the same file
    build_cache(front(jpeg_root), path, num_workers=2, multiprocessing_context=ctx,
                progress=False)
    for a, b in zip(records(path), records(built), strict=True):
        assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    ds = CachedDataset(built, transform=RandomCropFlipCHW(24))
    state = pickle.dumps(ds)
    assert len(state) < 4096  # the data is not pickled
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2,
                                         multiprocessing_context=ctx)
    n = 0
    for imgs, labels in loader:
        assert imgs.shape[1:] == (3, 24, 24) and imgs.dtype == torch.uint8
        n += len(labels)
    assert n == len(ds)


class WhoBuilds(JpegFolder):
    """Stores, with each sample, what torch.utils.data.get_worker_info() said while making it."""

    def __getitem__(self, i):
        img, label = super().__getitem__(i)
        info = torch.utils.data.get_worker_info()
        if info is None:
            return img, label, -1, 0, os.getpid(), ""
        return img, label, info.id, info.num_workers, os.getpid(), type(info.dataset).__name__


def test_build_runs_in_pooled_loader_workers(jpeg_root, tmp_path):
    path = str(tmp_path / "who.plc")
    build_cache(WhoBuilds(jpeg_root, transform=Chain([Decode(), ResizeMax(32)])), path,
                num_workers=2, chunk_size=2, progress=False)
    seen = [CachedDataset(path).raw(i)[2:] for i in range(24)]
    assert {s[0] for s in seen} == {0, 1}  # PooledLoader workers 0 and 1 made the records
    assert all(s[1] == 2 and s[2] != os.getpid() and s[3] == "_BuildTasks" for s in seen)
    assert len({s[2] for s in seen}) == 2
    path0 = str(tmp_path / "who0.plc")  # num_workers=0: in this process, through the loader
    build_cache(WhoBuilds(jpeg_root, transform=Chain([Decode(), ResizeMax(32)])), path0,
                num_workers=0, progress=False)
    assert {CachedDataset(path0).raw(i)[2:5] for i in range(24)} == {(-1, 0, os.getpid())}


# ---- resume and atomic visibility ------------------------------------------------------------

BUILD_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_cache import front
    from pooled_loader.cache import build_cache
    build_cache(front({root!r}, delay=0.05), {path!r}, num_workers=2, progress=False,
                chunk_size=2)
""")


def test_resume_after_sigkill(jpeg_root, tmp_path):
    path = str(tmp_path / "killed.plc")
    proc = subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT.format(
        tests=HERE, root=jpeg_root, path=path)], start_new_session=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            prog = partial_progress(path)
            if prog and prog[0] >= 6:
                break
            assert proc.poll() is None, "the build ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # the main process only, as the OOM killer would
        proc.wait()
        deadline = time.time() + 10  # its workers follow it (no orphan keeps writing)
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("build workers outlived the killed build")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done, total = partial_progress(path)
    assert 6 <= done < total == 24
    # not visible while unfinished, and a clear error that points to the partial file
    assert not os.path.exists(path) and os.path.exists(path + ".partial")
    with pytest.raises(CacheIncompleteError, match=r"\.partial.*build_cache"):
        CachedDataset(path)

    src = front(jpeg_root)
    build_cache(src, path, num_workers=0, progress=False)
    assert src.calls <= total - done  # finished records were kept, not recomputed
    clean = str(tmp_path / "clean.plc")
    build_cache(front(jpeg_root), clean, num_workers=0, progress=False)
    for a, b in zip(records(path), records(clean), strict=True):
        assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    CachedDataset(path).verify(front(jpeg_root))
    assert not os.path.exists(path + ".partial")


class Interrupting(JpegFolder):
    def __getitem__(self, i):
        if i == 10 and self.interrupt:
            raise KeyboardInterrupt
        return super().__getitem__(i)


def test_ctrl_c_keeps_finished_records(jpeg_root, tmp_path):
    path = str(tmp_path / "int.plc")
    ds = Interrupting(jpeg_root, transform=Chain([Decode(), ResizeMax(64)]))
    ds.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        build_cache(ds, path, num_workers=0, progress=False, chunk_size=1)
    assert not os.path.exists(path) and partial_progress(path) == (10, 24)
    ds.interrupt, ds.calls = False, 0
    build_cache(ds, path, num_workers=0, progress=False)
    assert ds.calls == 14
    assert [r[1] for r in records(path)] == [s[1] for s in ds.samples]


def test_resume_with_another_dataset_starts_afresh(jpeg_root, tmp_path):
    path = str(tmp_path / "swap.plc")
    ds = Interrupting(jpeg_root, transform=Chain([Decode(), ResizeMax(64)]))
    ds.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        build_cache(ds, path, progress=False, chunk_size=1)
    other = JpegFolder(jpeg_root, transform=Chain([Decode(), ResizeMax(48)]))
    with pytest.warns(UserWarning, match="starting afresh"):
        build_cache(other, path, progress=False)
    assert other.calls == 24
    CachedDataset(path, expect_fingerprint_of=other).verify()


def test_worker_error_names_the_sample(jpeg_root, tmp_path):
    root = make_jpegs(str(tmp_path / "imgs"), n=8)
    bad = os.path.join(root, "class_1", "img_004.jpg")
    with open(bad, "wb") as f:
        f.write(b"not a jpeg")
    with pytest.raises(CacheError, match=r"sample \d+ \(.*img_004.jpg\).*resume"):
        build_cache(front(root), str(tmp_path / "bad.plc"), num_workers=2, progress=False,
                    chunk_size=1)
    assert not os.path.exists(tmp_path / "bad.plc")


# ---- bad input --------------------------------------------------------------------------------

def corrupt(src, dst, offset, data=None, truncate=None):
    with open(src, "rb") as f:
        raw = bytearray(f.read())
    if truncate is not None:
        raw = raw[:truncate]
    if data is not None:
        raw[offset:offset + len(data)] = data
    with open(dst, "wb") as f:
        f.write(raw)
    return str(dst)


def test_other_format_version(built, tmp_path):
    bad = corrupt(built, tmp_path / "v.plc", 8, (FORMAT_VERSION + 1).to_bytes(4, "little"))
    with pytest.raises(CacheFormatError, match=rf"v\.plc.*version {FORMAT_VERSION + 1}.*rebuild"):
        CachedDataset(bad)


def test_not_a_cache_and_corrupted_preamble(built, tmp_path):
    with pytest.raises(CacheFormatError, match="not a pooled_loader cache"):
        CachedDataset(corrupt(built, tmp_path / "m.plc", 0, b"JUNKJUNK"))
    with pytest.raises(CacheFormatError, match="corrupted preamble"):
        CachedDataset(corrupt(built, tmp_path / "p.plc", 20, b"\x01"))


def test_truncated_file(built, tmp_path):
    size = os.path.getsize(built)
    with pytest.raises(CacheFormatError, match=r"t\.plc: truncated"):
        CachedDataset(corrupt(built, tmp_path / "t.plc", 0, truncate=size - 100))
    with pytest.raises(CacheFormatError, match="truncated"):
        CachedDataset(corrupt(built, tmp_path / "t2.plc", 0, truncate=size // 2))


def test_corrupted_header(built, tmp_path):
    size = os.path.getsize(built)
    bad = corrupt(built, tmp_path / "h.plc", size - 10, b"#")
    with pytest.raises(CacheFormatError, match="corrupted header"):
        CachedDataset(bad)


def test_corrupted_record_found_by_verify_and_check_crc(built, tmp_path):
    ds = CachedDataset(built)
    off = int(ds._arrays["leaf0.offset"][5, 0])
    bad = corrupt(built, tmp_path / "r.plc", off + 3,
                  bytes([(int(ds.raw(5)[0].reshape(-1)[3]) + 1) % 256]))
    with pytest.raises(CacheFormatError, match=r"record 5 .*crc32"):
        CachedDataset(bad).verify()
    with pytest.raises(CacheFormatError, match=r"record 5 .*crc32"):
        CachedDataset(bad, check_crc=True)[5]
    with pytest.raises(SampleError):  # so the loader's on_error="skip" can skip it
        CachedDataset(bad, check_crc=True).getitem_into(5, (np.zeros((1, 1, 3), np.uint8), None))
    CachedDataset(bad, check_crc=True)[4]  # the other records still read
    assert cli(["cache", "verify", bad]) == 1


def test_fingerprint_mismatch(jpeg_root, built, tmp_path):
    other = JpegFolder(jpeg_root, transform=Chain([Decode(), ResizeMax(32)]))
    assert dataset_fingerprint(other) != dataset_fingerprint(front(jpeg_root))
    with pytest.raises(CacheMismatchError, match="transform.*ResizeMax"):
        CachedDataset(built, expect_fingerprint_of=other)
    with pytest.raises(CacheMismatchError):
        CachedDataset(built).verify(other)
    # an edited source file changes the fingerprint too
    root = make_jpegs(str(tmp_path / "imgs"), n=6)
    path = str(tmp_path / "f.plc")
    build_cache(front(root), path, progress=False)
    p = front(root).samples[2][0]
    os.utime(p, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns + 10**9))
    with pytest.raises(CacheMismatchError, match="files_sha256"):
        CachedDataset(path, expect_fingerprint_of=front(root))
    # the same files reached through another path (relative, or a moved folder) still match
    moved = str(tmp_path / "moved")
    os.rename(root, moved)
    os.utime(os.path.join(moved, os.path.relpath(p, root)),
             ns=(os.stat(p.replace(root, moved)).st_atime_ns,
                 os.stat(p.replace(root, moved)).st_mtime_ns - 10**9))
    CachedDataset(path, expect_fingerprint_of=front(os.path.relpath(moved)))


def test_unfinished_partial_renamed_into_place(jpeg_root, tmp_path):
    path = str(tmp_path / "u.plc")
    ds = Interrupting(jpeg_root, transform=Chain([Decode(), ResizeMax(64)]))
    ds.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        build_cache(ds, path, progress=False, chunk_size=1)
    with pytest.raises(CacheIncompleteError, match=r"10 of 24 records"):
        CachedDataset(path)
    os.rename(path + ".partial", path)
    with pytest.raises(CacheIncompleteError, match="unfinished build"):
        CachedDataset(path)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        CachedDataset("/nonexistent/x.plc")


# ---- variants ---------------------------------------------------------------------------------

def random_front(root):
    return JpegFolder(root, transform=Chain([Decode(), ResizeMax(64), RandomCropFlipCHW(16)]))


def test_variants_reproducible_and_selected_per_epoch(jpeg_root, tmp_path):
    a, b = str(tmp_path / "a.plc"), str(tmp_path / "b.plc")
    build_cache(random_front(jpeg_root), a, variants=3, seed=7, num_workers=2, progress=False)
    build_cache(random_front(jpeg_root), b, variants=3, seed=7, num_workers=0, progress=False)
    ra, rb = records(a), records(b)
    assert all(np.array_equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(ra, rb, strict=True))
    c = str(tmp_path / "c.plc")
    build_cache(random_front(jpeg_root), c, variants=3, seed=8, num_workers=0, progress=False)
    assert any(not np.array_equal(x[0], y[0]) for x, y in zip(ra, records(c)))

    ds = CachedDataset(a)
    assert ds.variants == 3
    distinct = sum(len({ds.raw(i, k)[0].tobytes() for k in range(3)}) == 3 for i in range(len(ds)))
    assert distinct >= len(ds) - 2  # the variants really differ
    seen = {i: set() for i in range(len(ds))}
    for e in range(3):
        ds.set_epoch(e)
        for i in range(len(ds)):
            k = variant_for_epoch(7, e, i, 3)
            assert ds.variant(i) == k
            assert np.array_equal(ds[i][0], ds.raw(i, k)[0])
            seen[i].add(k)
    assert all(s == {0, 1, 2} for s in seen.values())  # every variant once per 3 epochs
    firsts = [variant_for_epoch(7, 0, i, 3) for i in range(len(ds))]
    assert len(set(firsts)) > 1  # samples start at different variants

    # the epoch reaches (fork) workers, reproducibly
    ds.set_epoch(4)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    for i, (img, label) in enumerate(loader):
        assert np.array_equal(img.numpy(), ds.raw(i, variant_for_epoch(7, 4, i, 3))[0])


# ---- CLI --------------------------------------------------------------------------------------

def test_cli_info_and_verify(built, capsys):
    assert main(["cache", "info", built]) == 0
    out = capsys.readouterr().out
    assert "24 x 1 variants" in out and "array |u1" in out and "fingerprint" in out
    assert main(["verify", built]) == 0
    assert cli(["cache", "info", built + ".missing"]) == 1


def test_cli_build(jpeg_root, tmp_path):
    vision = pytest.importorskip("pooled_loader.vision")
    if not hasattr(vision, "ImageFolder"):
        pytest.skip("pooled_loader.vision.ImageFolder has not landed")
    dst = str(tmp_path / "cli.plc")
    assert main(["cache", "build", jpeg_root, dst, "--max-side", "48", "--workers", "2",
                 "--quiet"]) == 0
    ds = CachedDataset(dst)
    assert len(ds) == 24 and max(ds.raw(0)[0].shape[:2]) <= 48


# ---- with the real pipeline and loader --------------------------------------------------------

def test_real_vision_pipeline_under_pooled_loader(jpeg_root, tmp_path):
    vision = pytest.importorskip("pooled_loader.vision")
    from pooled_loader import PooledLoader
    V = vision
    src = V.ImageFolder(jpeg_root, transform=V.Compose([V.DecodeImage(), V.Resize(max_side=64)]))
    path = str(tmp_path / "real.plc")
    build_cache(src, path, num_workers=2, progress=False)  # the pipeline runs in the workers
    ds = CachedDataset(path, transform=V.Compose([V.RandomResizedCrop(24),
                                                  V.RandomHorizontalFlip(), V.ToCHW()]),
                       expect_fingerprint_of=src)
    loader = PooledLoader(ds, batch_size=8, shuffle=True, num_workers=2)
    labels = []
    for imgs, lab in loader:
        assert imgs.shape[1:] == (3, 24, 24) and imgs.dtype == torch.uint8
        labels += lab.tolist()
    assert sorted(labels) == sorted(s[1] for s in src.samples)
    for i in range(len(src)):
        (img, label), (ref, ref_label) = ds.raw(i), src[i]
        assert np.array_equal(img, ref) and label == ref_label
    out = (np.zeros((3, 24, 24), np.uint8), None)
    res = ds.getitem_into(3, out)
    assert res[0] is out[0] and res[1] == src.samples[3][1]


# ---- bad source files: stop with one line, or skip and record; resume after a fix ------------

BAD_KINDS = ("zero_byte", "truncated", "not_an_image")
BAD_REASONS = {"zero_byte": "empty file", "truncated": "corrupt JPEG",
               "not_an_image": "not an image"}


def write_bad(root, kind, name=None):
    """One bad file of ``kind`` in ``root``'s class_1 (next to good JPEGs); its path."""
    path = os.path.join(root, "class_1", name or f"bad_{kind}.jpg")
    good = os.path.join(root, "class_0", sorted(os.listdir(os.path.join(root, "class_0")))[0])
    with open(good, "rb") as f:
        jpeg = f.read()
    data = {"zero_byte": b"", "truncated": jpeg[:len(jpeg) // 2],
            "not_an_image": b"this is a text file named .jpg\n"}[kind]
    with open(path, "wb") as f:
        f.write(data)
    return path


def write_cmyk(root):
    from PIL import Image
    img = np.random.default_rng(5).integers(0, 256, (50, 70, 3), np.uint8)
    path = os.path.join(root, "class_2", "cmyk.jpg")
    Image.fromarray(img).convert("CMYK").save(path, "JPEG", quality=90)
    return path


def vision_front(root):
    V = pytest.importorskip("pooled_loader.vision")
    return V.ImageFolder(root, transform=V.Compose([V.DecodeImage(), V.Resize(max_side=64)]))


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_file_stops_the_build_naming_the_file_and_the_reason(kind, tmp_path):
    root = make_jpegs(str(tmp_path / "imgs"), n=9)
    bad = write_bad(root, kind)
    path = str(tmp_path / "c.plc")
    with pytest.raises(CacheSampleError) as info:
        build_cache(vision_front(root), path, num_workers=2, progress=False)
    e = info.value
    assert e.file == bad and BAD_REASONS[kind] in e.reason and bad not in e.reason
    assert bad in str(e) and 'on_error="skip"' in str(e) and "\n" not in str(e)
    assert "Traceback" in str(e.__cause__)  # the worker's traceback travels as the cause
    assert not os.path.exists(path)


def test_skip_bad_leaves_bad_files_out_records_them_and_renumbers(tmp_path):
    root = make_jpegs(str(tmp_path / "imgs"), n=12)
    bad = {write_bad(root, kind): kind for kind in BAD_KINDS}
    cmyk = write_cmyk(root)
    src = vision_front(root)
    path = str(tmp_path / "c.plc")
    build_cache(src, path, num_workers=2, progress=False, on_error="skip", chunk_size=2)
    ds = CachedDataset(path, expect_fingerprint_of=src)
    paths = [p for p, _ in src.samples]
    assert len(src) == 16 and len(ds) == 13  # the CMYK JPEG decodes: it is not a bad file
    assert sorted(s["path"] for s in ds.skipped) == sorted(bad)
    for s in ds.skipped:
        assert paths[s["index"]] == s["path"] and BAD_REASONS[bad[s["path"]]] in s["reason"]
    kept = [i for i, p in enumerate(paths) if p not in bad]
    assert ds.source_indices.tolist() == kept and cmyk in [paths[i] for i in kept]
    for i, j in enumerate(ds.source_indices):  # dense indices, labels of the right source sample
        img, label = ds[i]
        ref, ref_label = src[int(j)]
        assert label == ref_label and np.array_equal(img, ref)
    from pooled_loader import PooledLoader
    labels = [int(v) for _, lab in PooledLoader(ds, batch_size=None, num_workers=2)
              for v in np.atleast_1d(lab)]
    assert labels == [src.samples[j][1] for j in kept]
    ds.verify()
    assert not os.path.exists(path + ".partial") and not os.path.exists(path + ".partial.journal")


def test_cmyk_jpeg_builds_without_skip(tmp_path):
    from PIL import Image
    root = make_jpegs(str(tmp_path / "imgs"), n=6)
    cmyk = write_cmyk(root)
    src = vision_front(root)
    path = str(tmp_path / "c.plc")
    build_cache(src, path, progress=False)
    ds = CachedDataset(path)
    i = [p for p, _ in src.samples].index(cmyk)
    assert len(ds) == len(src) and ds.skipped == []
    img = ds.raw(i)[0]
    assert np.array_equal(img, src[i][0])
    ref = np.asarray(Image.open(cmyk).convert("RGB").resize(img.shape[1::-1], Image.BILINEAR))
    assert np.abs(img.astype(int) - ref).mean() < 12  # the colours survived the conversion


def test_skip_gives_up_when_the_pipeline_itself_is_broken(jpeg_root, tmp_path):
    broken = JpegFolder(jpeg_root, transform=lambda x: 1 / 0)
    path = str(tmp_path / "c.plc")
    with pytest.raises(CacheError, match="every sample failed|broken pipeline"):
        build_cache(broken, path, progress=False, on_error="skip")
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")


class OddOne(JpegFolder):
    """Sample 5 has another structure (grey HW instead of HWC): a pipeline bug, not a bad file."""

    def __getitem__(self, i):
        img, label = super().__getitem__(i)
        return (img[..., 0] if i == 5 else img), label


def test_a_pipeline_error_in_a_worker_stops_the_build_in_one_line(jpeg_root, tmp_path):
    path = str(tmp_path / "c.plc")
    with pytest.raises(CacheError) as info:
        build_cache(OddOne(jpeg_root, transform=Decode()), path, num_workers=2,
                    progress=False, on_error="skip", chunk_size=2)
    msg = str(info.value)
    assert "\n" not in msg and "dataset[5]" in msg and "expected array ndim=3" in msg, msg
    assert "Traceback" in str(info.value.__cause__)  # the worker's report stays available


class CountingFolder:
    """vision.ImageFolder that counts the samples it loads (in-process builds) and raises
    KeyboardInterrupt at index ``stop_at``."""

    def __new__(cls, root, stop_at=None):
        V = pytest.importorskip("pooled_loader.vision")

        class Counting(V.ImageFolder):
            calls = 0

            def __getitem__(self, i):
                if i == stop_at:
                    raise KeyboardInterrupt
                type(self).calls += 1
                return super().__getitem__(i)

        Counting.__qualname__ = "CountingFolder"  # one class name for the fingerprint
        return Counting(root, transform=V.Compose([V.DecodeImage(), V.Resize(max_side=64)]))


@pytest.mark.parametrize("fix", ["remove", "replace", "rename"])
def test_a_failed_build_resumes_after_the_bad_file_is_fixed(fix, tmp_path):
    root = make_jpegs(str(tmp_path / "imgs"), n=12)
    bad = write_bad(root, "truncated", name="img_004b.jpg")  # in the middle of class_1
    path = str(tmp_path / "c.plc")
    src = CountingFolder(root)
    bad_index = [p for p, _ in src.samples].index(bad)
    with pytest.raises(CacheSampleError) as info:
        build_cache(src, path, progress=False, chunk_size=1)
    assert info.value.kept == bad_index and partial_progress(path) == (bad_index, 13)
    if fix == "remove":
        os.unlink(bad)
    elif fix == "rename":  # a PNG that was named .jpg, fixed by its name: a new sample
        os.rename(bad, bad[:-4] + ".png")
        with open(os.path.join(root, "class_0", "img_000.jpg"), "rb") as f:
            png = cv2_png(f.read())
        with open(bad[:-4] + ".png", "wb") as g:
            g.write(png)
    else:
        with open(os.path.join(root, "class_0", "img_000.jpg"), "rb") as f, \
                open(bad, "wb") as g:
            g.write(f.read())
    src = CountingFolder(root)
    build_cache(src, path, progress=False)
    assert len(src) == 13 - (fix == "remove")
    assert src.calls == len(src) - bad_index  # the finished records were kept
    clean = str(tmp_path / "clean.plc")
    build_cache(CountingFolder(root), clean, progress=False)
    for a, b in zip(records(path), records(clean), strict=True):
        assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    CachedDataset(path, expect_fingerprint_of=src).verify()


def cv2_png(jpeg):
    import cv2
    img = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    return cv2.imencode(".png", img)[1].tobytes()


def test_a_change_to_an_already_cached_file_starts_over_saying_why(tmp_path):
    root = make_jpegs(str(tmp_path / "imgs"), n=12)
    bad = write_bad(root, "zero_byte")
    path = str(tmp_path / "c.plc")
    with pytest.raises(CacheSampleError):
        build_cache(CountingFolder(root), path, progress=False, chunk_size=1)
    os.unlink(bad)
    first = os.path.join(root, "class_0", "img_000.jpg")  # already cached
    st = os.stat(first)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    src = CountingFolder(root)
    with pytest.warns(UserWarning, match="1 already cached sample changed.*starting afresh"):
        build_cache(src, path, progress=False)
    assert src.calls == len(src)


def test_skipped_samples_are_retried_when_a_build_resumes(tmp_path):
    root = make_jpegs(str(tmp_path / "imgs"), n=12)
    bad = write_bad(root, "not_an_image")
    path = str(tmp_path / "c.plc")

    with pytest.raises(KeyboardInterrupt):
        build_cache(CountingFolder(root, stop_at=10), path, progress=False, chunk_size=1,
                    on_error="skip")
    assert partial_progress(path) == (9, 13)  # the bad file got no record
    os.unlink(bad)  # fixed while interrupted: resumes, and nothing is skipped any more
    src = CountingFolder(root)
    build_cache(src, path, progress=False, on_error="skip")
    ds = CachedDataset(path)
    assert len(ds) == 12 and ds.skipped == [] and src.calls == 12 - 9


def test_a_dataset_built_to_skip_bad_files_is_cached_with_skip(tmp_path):
    V = pytest.importorskip("pooled_loader.vision")
    root = make_jpegs(str(tmp_path / "imgs"), n=6)
    bad = write_bad(root, "not_an_image")
    src = V.ImageFolder(root, transform=V.Compose([V.DecodeImage()]), on_error="skip")
    build_cache(src, str(tmp_path / "c.plc"), progress=False)  # as PooledLoader reads it
    assert [s["path"] for s in CachedDataset(str(tmp_path / "c.plc")).skipped] == [bad]


# ---- the command line, as a user runs it ------------------------------------------------------

def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    return subprocess.run([sys.executable, "-m", "pooled_loader", *args], capture_output=True,
                          text=True, env=env, timeout=240)


def test_cli_build_stops_with_one_line_then_resumes_or_skips(tmp_path, capsys):
    pytest.importorskip("pooled_loader.vision")
    root = make_jpegs(str(tmp_path / "imgs"), n=12)
    bad = write_bad(root, "zero_byte")
    dst = str(tmp_path / "c.plc")
    build = ["cache", "build", root, dst, "--workers", "2", "--quiet", "--max-side", "48"]
    r = run_cli(*build)  # as a user runs it: a process of its own
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and bad in lines[0] and "empty file" in lines[0]
    assert "run the same command again" in lines[0] and "--skip-bad" in lines[0]
    assert cli(build + ["--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")
    os.unlink(bad)  # fixed: the same command resumes (the progress bar shows where)
    assert cli([a for a in build if a != "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "12 samples" in out and re.search(r"resuming .*c\.plc\.partial: \d+ of 12", err), err
    bad = write_bad(root, "truncated")
    assert cli(build + ["--skip-bad", "--overwrite"]) == 0
    assert "1 of 13 samples skipped (see `python -m pooled_loader cache info" \
        in capsys.readouterr().out
    assert cli(["cache", "info", dst]) == 0
    assert f"{bad}: corrupt JPEG" in capsys.readouterr().out


@pytest.mark.parametrize("args", [
    ["cache", "info", "/nonexistent/c.plc"],
    ["cache", "build", "/nonexistent/imgs", "/tmp/never.plc", "--quiet"],
    ["shards", "write", "/nonexistent/imgs", "/tmp/never-%03d.tar", "--per-shard", "2"],
    ["tune", "--data", "/nonexistent/imgs"],
])
def test_every_command_reports_a_user_error_in_one_line(args, capsys):
    assert cli(args) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent/" in lines[0], err
