"""Ragged batches (issue 26): pad/packed/as_list written by real workers into pool slots, each
equal to what a DataLoader with an independent Python collate gives."""
import json

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, IterableDataset

from pooled_loader import PooledLoader
from pooled_loader.ragged.collate import Packed, Padded, as_list, packed, pad
from pooled_loader.engine.cuda import DeviceIter
from test_cuda import ManualBackend

# The comparisons keep every batch of an epoch: the pool grows (and says so), as it should.
pytestmark = pytest.mark.filterwarnings("ignore:PooledLoader. every slot")


class Tokens(Dataset):
    """Token lists of varying length (0 to 40), as int64 tensors."""

    def __init__(self, n=37, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(0, 41, size=n)
        self.seed = seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.arange(int(self.lengths[i]), dtype=torch.int64) * 7 + i


class Detection(Dataset):
    """Images of varying size (uint8 ndarray HWC) with a box list of varying length each."""

    def __len__(self):
        return 23

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        image = rng.integers(0, 256, size=(8 + i % 5, 6 + i % 3, 3), dtype=np.uint8)
        boxes = torch.from_numpy(rng.random((i % 4, 4), dtype=np.float32))
        return image, boxes


class Mixed(Dataset):
    """A fixed-size image, ragged boxes, a label and a name."""

    def __len__(self):
        return 19

    def __getitem__(self, i):
        return {"image": torch.full((3, 4, 4), i, dtype=torch.uint8),
                "boxes": torch.arange((i % 3) * 4, dtype=torch.float32).reshape(-1, 4) + i,
                "label": i, "name": f"img{i}"}


def py_pad(samples, value=0):
    values = pad_sequence(list(samples), batch_first=True, padding_value=value)
    lengths = torch.tensor([len(s) for s in samples])
    mask = torch.arange(values.shape[1])[None, :] < lengths[:, None]
    if values.dim() > 2:  # rows of equal width (boxes): shapes, and a mask over every element
        mask = mask[:, :, None].expand(values.shape).clone()
        lengths = torch.tensor([list(s.shape) for s in samples]).reshape(len(samples), -1)
    return Padded(values, lengths, mask)


def py_packed(samples):
    lengths = torch.tensor([len(s) for s in samples])
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    return Packed(torch.cat(list(samples)), cu, positions)


def py_zip(batch):
    images, boxes = tuple(zip(*batch))
    return tuple(torch.from_numpy(x) for x in images), boxes


def assert_same(a, b, where="batch"):
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs " \
                                                          f"{b.dtype}{b.shape}"
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_loaders_equal(ours, theirs):
    ours, theirs = list(ours), list(theirs)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_same(a, b, f"batch {i}")


@pytest.mark.parametrize("workers", [0, 2])
def test_padded_token_batches_equal_a_python_pad_collate(workers):
    ds = Tokens()
    ours = PooledLoader(ds, batch_size=5, num_workers=workers, collate_fn=pad(pad_value=-3))
    theirs = DataLoader(ds, batch_size=5, collate_fn=lambda b: py_pad(b, -3))
    assert_loaders_equal(ours, theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_token_batches_give_varlen_cu_seqlens_and_position_ids(workers):
    ds = Tokens()
    ours = PooledLoader(ds, batch_size=6, num_workers=workers, collate_fn=packed())
    theirs = DataLoader(ds, batch_size=6, collate_fn=py_packed)
    assert_loaders_equal(ours, theirs)
    batch = next(iter(ours))
    assert batch.cu_seqlens.dtype == torch.int32 and batch.values.dim() == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_variable_images_and_box_lists_as_list_equal_tuple_zip(workers):
    ds = Detection()
    ours = PooledLoader(ds, batch_size=4, num_workers=workers, collate_fn=as_list())
    assert_loaders_equal(ours, DataLoader(ds, batch_size=4, collate_fn=py_zip))


def test_batches_are_views_of_the_pool_slot_not_copies():
    loader = PooledLoader(Detection(), batch_size=4, num_workers=1, collate_fn=as_list())
    images, boxes = next(iter(loader))
    arenas = loader._get_pool().arenas()
    for t in images + boxes:
        if t.numel():
            address = t.data_ptr()
            assert any(a.address <= address < a.address + a.nbytes for a in arenas)


def test_fixed_image_is_stacked_and_ragged_boxes_take_each_form():
    ds = Mixed()
    for helper, form in ((pad(ragged=["boxes"]), lambda b: py_pad(b)),
                         (packed(ragged=["boxes"]), py_packed),
                         (as_list(ragged=["boxes"]), tuple)):
        def reference(samples, form=form):
            return {"image": torch.stack([s["image"] for s in samples]),
                    "boxes": form([s["boxes"] for s in samples]),
                    "label": torch.tensor([s["label"] for s in samples]),
                    "name": [s["name"] for s in samples]}
        ours = PooledLoader(ds, batch_size=4, num_workers=2, collate_fn=helper)
        assert_loaders_equal(ours, DataLoader(ds, batch_size=4, collate_fn=reference))


def test_helpers_are_ordinary_collate_functions_for_dataloader_workers():
    ds = Mixed()
    for helper in (pad(ragged=["boxes"]), packed(ragged=["boxes"]), as_list(ragged=["boxes"])):
        ours = PooledLoader(ds, batch_size=4, num_workers=2, collate_fn=helper)
        theirs = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=helper)
        assert_loaders_equal(ours, theirs)


def test_padding_of_images_fills_every_dimension_and_rounds_to_a_multiple():
    images = [torch.ones(2, 3, dtype=torch.float32), torch.full((4, 1), 2.0)]
    out = pad(pad_value=-1.0, to_multiple_of=4)(images)
    assert out.values.shape == (2, 4, 4) and out.mask.shape == (2, 4, 4)
    assert out.lengths.tolist() == [[2, 3], [4, 1]]
    assert (out.values[0, :2, :3] == 1).all() and (out.values[0][~out.mask[0]] == -1).all()
    assert out.mask[1].sum() == 4 and (out.values[1, :, 0] == 2).all()


def test_bfloat16_and_ndarray_leaves_keep_their_dtype_as_default_collate_would():
    samples = [torch.ones(3, dtype=torch.bfloat16), torch.ones(1, dtype=torch.bfloat16)]
    out = pad(pad_value=0.5)(samples)
    assert out.values.dtype == torch.bfloat16 and out.values[1, 2].item() == 0.5
    arrays = [np.arange(3, dtype=np.int16), np.arange(2, dtype=np.int16)]
    assert packed()(arrays).values.dtype == torch.int16


def test_batches_larger_than_the_slot_get_a_bigger_slot_and_none_after_warm_up():
    class Growing(Tokens):
        def __getitem__(self, i):
            return torch.zeros(100 * (i + 1), dtype=torch.int64)
    loader = PooledLoader(Growing(12), batch_size=3, num_workers=2, persistent_workers=True,
                          collate_fn=pad())
    for _ in range(2):
        lengths = [b.values.shape[1] for b in loader]
    assert lengths == [300, 600, 900, 1200]
    assert loader.stats()["allocations_after_warmup"] == 0


def test_in_order_false_hands_out_every_ragged_batch_once():
    ds = Tokens(50)
    got = list(PooledLoader(ds, batch_size=4, num_workers=2, in_order=False, collate_fn=packed()))
    expected = list(DataLoader(ds, batch_size=4, collate_fn=py_packed))
    key = lambda b: b.values.tolist()  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, expected))


def test_resume_mid_epoch_continues_with_the_same_ragged_batches():
    ds = Tokens(40)
    loader = PooledLoader(ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=pad(),
                          generator=torch.Generator().manual_seed(5))
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    rest = list(it)
    fresh = PooledLoader(ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=pad(),
                         generator=torch.Generator().manual_seed(99))
    fresh.load_state_dict(state)
    assert len(head) == 3
    assert_loaders_equal(fresh, rest)


def test_iterable_datasets_are_collated_by_the_helpers_too():
    class Stream(IterableDataset):
        def __iter__(self):
            return (torch.arange(i % 5) for i in range(11))
    assert_loaders_equal(PooledLoader(Stream(), batch_size=3, num_workers=1, collate_fn=pad()),
                         DataLoader(Stream(), batch_size=3, collate_fn=py_pad))


def test_default_collate_still_refuses_ragged_samples_like_dataloader():
    with pytest.raises(RuntimeError):
        list(DataLoader(Tokens(), batch_size=4))
    with pytest.raises(RuntimeError):
        list(PooledLoader(Tokens(), batch_size=4))


def test_bad_samples_give_errors_naming_the_field_and_the_sample():
    a, b = {"x": torch.ones(2, 3)}, {"x": torch.ones(2, 4)}
    with pytest.raises(ValueError, match=r"packed\(\), field 'x'.*sample 1 .*use pad\(\)"):
        packed()([a, b])
    with pytest.raises(ValueError, match=r"field 'x'.*sample 1 .*dtype int64"):
        pad()([a, {"x": torch.ones(2, dtype=torch.int64)}])
    with pytest.raises(ValueError, match=r"field 'image'.*sample 1 .*name it in ragged="):
        as_list(ragged=["boxes"])([{"image": torch.ones(2), "boxes": torch.ones(1)},
                                   {"image": torch.ones(3), "boxes": torch.ones(1)}])
    with pytest.raises(ValueError, match="structure"):
        pad()([a, {"y": torch.ones(2)}])
    with pytest.raises(TypeError, match="ragged="):
        pad(ragged="boxes")
    loader = PooledLoader(Tokens(), batch_size=4, num_workers=1,
                          collate_fn=pad(ragged=["nope"]))
    with pytest.raises(ValueError, match=r"sample \d+ has shape"):
        list(loader)


def test_the_device_stage_copies_the_used_bytes_not_the_slot():
    copied = []

    class Counting(ManualBackend):
        def copy(self, t):
            copied.append(t.nbytes)
            return t.clone()

        def record(self):
            return object()

        def hand_over(self, event, tensors):
            pass

        def done(self, event):
            return True

        def wait(self, event):
            pass

    loader = PooledLoader(Tokens(), batch_size=5, num_workers=1, collate_fn=packed())
    batches = list(DeviceIter(iter(loader), torch.device("cpu"), backend=Counting()))
    expected = sum(t.nbytes for b in batches for t in b)
    assert sum(copied) == expected
    assert max(copied) < loader.stats()["slot_bytes"]


def test_size_classes_are_page_aligned_and_waste_under_a_fifth():
    from pooled_loader.engine.size_classes import SIZE_CLASS_FLOOR, size_class
    previous = 0
    for n in [1, 4096, SIZE_CLASS_FLOOR, SIZE_CLASS_FLOOR + 1, 10**6, 3 * 2**20 + 5, 10**9]:
        c = size_class(n)
        assert c >= n and c % 4096 == 0 and c >= previous
        assert c == SIZE_CLASS_FLOOR or c < 1.19 * n + 4096
        previous = c


def test_one_huge_batch_gets_a_slot_of_its_class_not_a_pool_of_them():
    class OneHuge(Tokens):
        def __getitem__(self, i):
            return torch.ones(2**20 if i == 13 else 100, dtype=torch.int64)  # 8 MiB vs 800 B
    loader = PooledLoader(OneHuge(40), batch_size=4, num_workers=2, collate_fn=packed())
    for _ in range(2):
        sizes = [len(b.values) for b in loader]
    assert sizes[3] == 2**20 + 300 and sizes.count(400) == 9
    stats = loader.stats()
    huge = max(stats["size_classes"])
    assert len(stats["size_classes"]) == 2 and huge >= 8 * 2**20
    assert stats["peak_bytes"] < 3 * huge < stats["slots"] * huge  # 2 huge slots, not 6
    assert stats["arenas"] == 2 and stats["allocations_after_warmup"] == 0


def test_the_typical_class_follows_the_batches_and_small_idle_arenas_retire():
    from pooled_loader import SlotPool
    pool = SlotPool(4096, 3)
    for used in [10_000] * 5 + [900_000] * 70:
        ref = pool.acquire(used)
        pool.lease(ref, used)  # dropped at once: the slot comes back
    stats = pool.stats()
    assert stats["slot_bytes"] >= 900_000 and stats["arenas"] == 1  # the 64 KiB one retired
    assert pool.counters["grown_dry"] == 0


def test_dtype_casts_ragged_values_while_writing_them():
    samples = [np.arange(3, dtype=np.uint16), np.arange(1, dtype=np.uint16)]
    for helper in (pad(pad_value=-1, dtype=torch.int64), packed(dtype=torch.int64),
                   as_list(dtype=torch.int64)):
        ours = next(iter(PooledLoader(samples, batch_size=2, num_workers=1, collate_fn=helper)))
        assert_same(ours, helper(samples))
    out = pad(pad_value=-1, dtype=torch.int64)(samples)
    assert out.values.tolist() == [[0, 1, 2], [0, -1, -1]]
    with pytest.raises(TypeError, match="dtype="):
        pad(dtype=np.int64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ragged_batches_on_the_gpu_equal_the_host_batches_and_come_from_pinned_slots():
    ds = Detection()
    host = list(PooledLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list()))
    gpu = list(PooledLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list(),
                            device="cuda"))
    assert len(gpu) == len(host)
    for h, g in zip(host, gpu):
        assert all(t.is_cuda for field in g for t in field)
        assert_same(h, tuple(tuple(t.cpu() for t in field) for field in g))
    pinned = next(iter(PooledLoader(Tokens(), batch_size=4, num_workers=1, pin_memory=True,
                                    collate_fn=pad())))
    assert pinned.values.is_pinned() and pinned.mask.is_pinned()
