"""Resume with real data (issue 9): ImageFolder with random crops and flips, CachedDataset with
variants, and map-style loaders on gloo ranks."""
from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from imgutil import make_folder
from ranks import run_ranks
from pooled_loader import PooledLoader
from pooled_loader.cache import CachedDataset, build_cache
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                  RandomResizedCrop, ToCHW)
from resume_datasets import Noisy, RandomCropCHW
from test_cache import make_jpegs, random_front

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def epoch(loader, stop_after=None):
    """The epoch's batches as tensors, and the state after `stop_after` of them."""
    batches, state = [], None
    for batch in loader:
        batches.append(batch.clone() if isinstance(batch, torch.Tensor) else
                       [t.clone() if isinstance(t, torch.Tensor) else t for t in batch])
        if len(batches) == stop_after:
            state = json.loads(json.dumps(loader.state_dict()))
    return batches, state


def assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_image_folder_with_random_crop_and_flip_resumes_bit_identically(tmp_path):
    root = str(tmp_path / "imgs")
    make_folder(root, n_per_class=7)

    def make(workers):
        ds = ImageFolder(root, transform=Compose([DecodeImage(), RandomResizedCrop(24),
                                                  RandomHorizontalFlip(), ToCHW()]))
        return PooledLoader(ds, batch_size=3, shuffle=True, num_workers=workers,
                            per_sample_seed=True, generator=torch.Generator().manual_seed(4))

    full, state = epoch(make(2), stop_after=2)
    assert_same(epoch(make(2))[0], full)  # the augmentation is random per sample, reproducibly
    for workers in (2, 0):
        loader = make(workers)
        loader.load_state_dict(state)
        assert_same(epoch(loader)[0], full[2:])


def test_cached_dataset_with_variants_resumes_exactly_in_its_epoch(tmp_path):
    jpegs = make_jpegs(str(tmp_path / "jpegs"), n=12)
    path = str(tmp_path / "c.plc")
    build_cache(random_front(jpegs), path, variants=2, seed=3, num_workers=0, progress=False)

    def make():
        ds = CachedDataset(path, transform=RandomCropCHW(8))
        return PooledLoader(ds, batch_size=4, shuffle=True, num_workers=2, per_sample_seed=True,
                            persistent_workers=True, generator=torch.Generator().manual_seed(1))

    loader = make()
    loader.set_epoch(0)
    epoch0, _ = epoch(loader)
    loader.set_epoch(1)
    epoch1, state = epoch(loader, stop_after=1)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(epoch0, epoch1))  # another variant
    resumed = make()
    resumed.load_state_dict(state)
    assert_same(epoch(resumed)[0], epoch1[1:])


WORLD = 2


def rank_main(rank, port, out_dir):
    """One rank: an epoch with a state saved after 2 batches, then a new loader resumed from it;
    the collective per batch keeps the ranks in step as DDP would."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=30))
    try:
        def make():
            loader = PooledLoader(Noisy(23), batch_size=3, shuffle=True, distributed=True,
                                  num_workers=1, per_sample_seed=True)
            loader.set_epoch(5)
            return loader
        full, state = [], None
        loader = make()
        for batch in loader:
            full.append([batch[0].tolist(), batch[1].tolist()])
            dist.all_reduce(torch.ones(1))
            if len(full) == 2:
                state = json.loads(json.dumps(loader.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        rest = [[b[0].tolist(), b[1].tolist()] for b in resumed]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"full": full, "rest": rest, "rank": state["_pooled"]["rank"]}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_each_gloo_rank_saves_and_resumes_its_own_shard(tmp_path):
    run_ranks(rank_main, WORLD, (str(tmp_path),), deadline_s=120)
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    seen = []
    for r, res in enumerate(results):
        assert res["rank"] == r
        assert res["rest"] == res["full"][2:]
        seen += [i for b in res["full"] for i in b[0]]
    assert sorted(seen)[:23] == list(range(23)) or set(seen) == set(range(23))


def test_webdataset_resumes_through_the_loader_with_its_own_state(tmp_path):
    """The loader calls WebDataset.state_dict() inside each worker and restores it there; the
    resumed loader continues each worker's stream mid-shard."""
    import webdataset as wds
    from pooled_loader.shards.webdataset import WebDataset
    gid = 0
    for s, size in enumerate([7, 5, 9, 6]):
        with wds.TarWriter(str(tmp_path / f"shard-{s}.tar"), encoder=False) as w:
            for _ in range(size):
                w.write({"__key__": f"{gid:06d}", "txt": str(gid).encode()})
                gid += 1
    urls = sorted(str(p) for p in tmp_path.glob("shard-*.tar"))

    def make():
        ds = WebDataset(urls, transform=lambda s: int(s["txt"]), shuffle_buffer=4, seed=3)
        return PooledLoader(ds, batch_size=3, num_workers=2, snapshot_every_n_steps=2)

    loader = make()
    full, state = epoch(loader, stop_after=3)
    assert state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"] is not None
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in epoch(resumed)[0]] == [b.tolist() for b in full[3:]]
