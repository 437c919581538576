"""pooled_loader.video (issue 49): clips decoded from real H.264/MP4 and VP9/WebM files the tests
make, through real worker processes into the slot: the decoder's own frames at the clip's
times, torchvision v2's own draws and pixels, the same clips with 0 or 2 workers, exact
mid-epoch and elastic resume, shards, Mix."""
from __future__ import annotations

import importlib.util
import io
import itertools
import os
import tarfile

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
v2 = pytest.importorskip("torchvision.transforms.v2")
from torchvision import tv_tensors  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.core.seeds import sample_seed  # noqa: E402
from pooled_loader.mix import Mix  # noqa: E402
from pooled_loader.video import VideoClips  # noqa: E402

_spec = importlib.util.spec_from_file_location("make_videos", os.path.join(
    os.path.dirname(__file__), os.pardir, "scripts", "tools", "make_videos.py"))
mv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mv)

RRC = v2.Compose([v2.RandomResizedCrop((64, 80)), v2.RandomHorizontalFlip()])
EVAL = v2.Compose([v2.Resize(72), v2.CenterCrop(64), v2.RandomHorizontalFlip(),
                   v2.ToDtype(torch.float32, scale=True),
                   v2.Normalize([0.43, 0.4, 0.37], [0.22, 0.22, 0.21])])


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """6 videos in 2 class folders (one VP9/WebM in each), 60 frames at 30 fps, 160x120."""
    root = str(tmp_path_factory.mktemp("videos"))
    mv.make_videos(root, 6, classes=2, width=160, height=120, frames_per_video=60,
                   webm_every=3)
    return root


def decoded(path: str) -> tuple[list[np.ndarray], list[float]]:
    """Every frame of the file as FFmpeg gives it (PyAV's own conversion), and its time."""
    with av.open(path) as c:
        s = c.streams.video[0]
        got = [(f.to_ndarray(format="rgb24"), float((f.pts - (s.start_time or 0)) * s.time_base))
               for f in c.decode(s)]
    return [g[0] for g in got], [g[1] for g in got]


def epochs(loader, n=2):
    return [[tuple(x.clone() if torch.is_tensor(x) else x for x in b) for b in loader]
            for _ in range(n)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.equal(torch.as_tensor(u), torch.as_tensor(v))


def test_frames_are_the_decoders_own_at_the_clips_times(videos):
    ds = VideoClips(videos, frames_per_clip=8, frame_step=3, return_timestamps=True)
    assert ds.classes == ["class_000", "class_001"] and len(ds) == 6
    for i in range(len(ds)):
        clip, label, stamps = ds[i]
        path = ds.table.name(i)
        assert label == int(os.path.basename(os.path.dirname(path))[-1])
        frames, times = decoded(path)
        assert clip.shape == (8, 3, 120, 160) and clip.dtype == torch.uint8
        first = times.index(stamps[0])
        assert np.allclose(stamps, times[first:first + 22:3])  # every third frame
        for j, k in enumerate(range(first, first + 22, 3)):
            assert np.array_equal(clip[j].permute(1, 2, 0).numpy(), frames[k]), (path, j)
            assert mv.frame_number(frames[k]) == k


def test_fps_takes_the_frame_shown_at_each_time(videos):
    ds = VideoClips(videos, frames_per_clip=6, fps=10, return_timestamps=True)
    clip, _, stamps = ds[1]
    numbers = [mv.frame_number(f.permute(1, 2, 0).numpy()) for f in clip]
    assert np.diff(numbers).tolist() == [3] * 5  # 30 fps sampled at 10
    assert np.allclose(np.diff(stamps), 0.1, atol=0.002)


def test_uniform_clips_are_segment_centres_every_epoch(videos):
    ds = VideoClips(videos, frames_per_clip=4, clips_per_video=3, sampler="uniform",
                    return_timestamps=True)
    starts = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        starts.append([mv.frame_number(ds[i][0][0].permute(1, 2, 0).numpy()) for i in range(3)])
    assert starts[0] == starts[1] == [9, 28, 47]  # 57 starts, centres of three thirds


@pytest.mark.parametrize("transform", [RRC, EVAL], ids=["rrc_flip", "resize_crop_normalize"])
def test_v2_video_pipeline_same_draws_and_pixels_as_torchvision(videos, transform):
    raw = VideoClips(videos, frames_per_clip=5, frame_step=2, seed=7)
    ds = VideoClips(videos, frames_per_clip=5, frame_step=2, seed=7, transform=transform)
    assert ds.describe()["as_is"] == [] and ds.describe()["why_not_fused"] == ""
    one_level = 1.0 if transform is RRC else 1 / 255 / 0.21 + 1e-6
    for i in range(len(ds)):
        ours = ds[i][0]
        torch.manual_seed(sample_seed(7, 0, i))  # the clip's draws: torch's RNG, this seed
        theirs = transform(tv_tensors.Video(raw[i][0]))
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        diff = (ours.float() - theirs.float()).abs()
        assert float(diff.max()) <= one_level and float(diff.mean()) < 0.25 * one_level


def test_ops_not_fused_run_as_torchvisions_and_say_why(videos):
    t = v2.Compose([v2.RandomResizedCrop(48), v2.ColorJitter(0.4, 0.4), v2.RandomHorizontalFlip()])
    ds = VideoClips(videos, frames_per_clip=4, transform=t, seed=1)
    d = ds.describe()
    assert d["as_is"] == ["ColorJitter", "RandomHorizontalFlip"] and "ColorJitter" in \
        d["why_not_fused"]
    raw = VideoClips(videos, frames_per_clip=4, seed=1)
    torch.manual_seed(sample_seed(1, 0, 2))
    theirs = t(tv_tensors.Video(raw[2][0]))
    ours = ds[2][0]
    assert isinstance(ours, tv_tensors.Video) and ours.shape == theirs.shape
    assert float((ours.float() - theirs.float()).abs().mean()) < 1.0


def test_clip_written_into_the_slot_row_itself(videos):
    ds = VideoClips(videos, frames_per_clip=4, transform=RRC)
    out = np.zeros((4, 3, 64, 80), np.uint8)
    clip, label = ds.getitem_into(0, (out, np.zeros((), np.int64)))
    assert clip is out and out.any()


def test_same_clips_with_0_or_2_workers_and_new_clips_each_epoch(videos):
    ds = VideoClips(videos, frames_per_clip=4, frame_step=2, clips_per_video=2, transform=RRC)
    runs = {w: epochs(PooledLoader(ds, batch_size=3, shuffle=True, num_workers=w,
                                   generator=torch.Generator().manual_seed(5)))
            for w in (0, 2)}
    same(runs[0][0], runs[2][0])
    same(runs[0][1], runs[2][1])
    assert not torch.equal(runs[0][0][0][0], runs[0][1][0][0])
    assert runs[0][0][0][0].shape == (3, 4, 3, 64, 80)


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_gives_the_rest_of_the_epoch(videos, workers):
    ds = VideoClips(videos, frames_per_clip=4, clips_per_video=2, transform=EVAL)

    def loader():
        return PooledLoader(ds, batch_size=2, shuffle=True, num_workers=workers,
                            generator=torch.Generator().manual_seed(3))
    full = loader()
    first = epochs(full, 1)[0]
    second = epochs(full, 1)[0]
    saver = loader()
    for _ in saver:  # epoch 0, its batches dropped as they come
        pass
    it = iter(saver)
    head = [tuple(x.clone() for x in b) for b in itertools.islice(it, 2)]
    state = saver.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    tail = [tuple(x.clone() for x in b) for b in resumed]
    same(head + tail, second)
    assert not torch.equal(first[0][0], second[0][0])


def test_elastic_resume_2_ranks_to_3_gives_each_clip_once_as_drawn(videos, monkeypatch):
    ds = VideoClips(videos, frames_per_clip=3, clips_per_video=4, transform=RRC)
    n = len(ds)  # 24 clips

    def rank_loader(rank, world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        return PooledLoader(_Indexed(ds), batch_size=2, shuffle=True, distributed=True,
                            num_workers=0)

    got, states = {}, []
    for rank in range(2):
        loader = rank_loader(rank, 2)
        it = iter(loader)
        for clip, _, index in itertools.islice(it, 2):
            for c, i in zip(clip, index.tolist()):
                got.setdefault(i, []).append(c.clone())
        states.append(loader.state_dict())
        del it
    from pooled_loader.resume import merge_rank_states
    merged = merge_rank_states(states)
    for rank in range(3):
        loader = rank_loader(rank, 3)
        loader.load_state_dict(merged)
        for clip, _, index in loader:
            for c, i in zip(clip, index.tolist()):
                got.setdefault(i, []).append(c.clone())
    assert set(got) == set(range(n))
    for i, clips in got.items():  # padding may repeat a clip: as drawn for its index
        reference = ds[i][0]
        assert all(torch.equal(c, reference) for c in clips), i


class _Indexed(torch.utils.data.Dataset):
    """A clip with its index, so ranks' deliveries can be told apart."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        clip, label = self.ds[i]
        return clip, label, i


def _write_shard(path: str, files: list[tuple[str, int]]) -> None:
    with tarfile.open(path, "w") as tar:
        for k, (video, label) in enumerate(files):
            ext = os.path.splitext(video)[1]
            tar.add(video, arcname=f"sample{k:04d}{ext}")
            info = tarfile.TarInfo(f"sample{k:04d}.cls")
            data = str(label).encode()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_shards_give_the_folders_clips(videos, tmp_path):
    folder = VideoClips(videos, frames_per_clip=4, transform=RRC, seed=2)
    files = [folder.table.name(i) for i in range(len(folder.table))]
    labels = [folder.table.label(i) for i in range(len(folder.table))]
    _write_shard(str(tmp_path / "a.tar"), list(zip(files[:4], labels[:4])))
    _write_shard(str(tmp_path / "b.tar"), list(zip(files[4:], labels[4:])))
    shards = VideoClips(str(tmp_path / "{a,b}.tar"), frames_per_clip=4, transform=RRC, seed=2)
    assert len(shards) == len(folder)
    assert shards.table.name(5).endswith("b.tar:sample0001")
    for i in range(len(folder)):
        a, b = folder[i], shards[i]
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
    loader = PooledLoader(shards, batch_size=2, num_workers=2)
    assert sum(len(b[0]) for b in loader) == 6


def test_inside_a_mix_the_same_with_0_or_2_workers(videos):
    a = VideoClips(videos, frames_per_clip=3, transform=RRC, seed=1)
    b = VideoClips(videos, frames_per_clip=3, transform=RRC, seed=2, clips_per_video=2)
    runs = {}
    for w in (0, 2):
        mix = Mix({"a": a, "b": b}, {"a": 1.0, "b": 2.0}, seed=4, samples_per_epoch=12,
                  stop="never")
        runs[w] = epochs(PooledLoader(mix, batch_size=3, num_workers=w), 1)[0]
    same(runs[0], runs[2])
    assert sum(len(x[0]) for x in runs[0]) == 12


@pytest.mark.parametrize("kwargs,match", [
    (dict(frames_per_clip=0), "frames_per_clip"),
    (dict(frames_per_clip=4, frame_step=2, fps=10), "not both"),
    (dict(frames_per_clip=4, sampler="dense"), "sampler"),
    (dict(frames_per_clip=4, clips_per_video=True), "clips_per_video"),
    (dict(frames_per_clip=4, fps=0), "fps"),
])
def test_bad_arguments_are_named(videos, kwargs, match):
    with pytest.raises(ValueError, match=match):
        VideoClips(videos, **kwargs)


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        VideoClips(str(tmp_path / "nowhere"), frames_per_clip=2)
