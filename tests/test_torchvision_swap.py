"""torchvision pipelines under PooledLoader: tensor subclasses (tv_tensors) in slots, and the
translation of an unchanged ImageFolder + Compose onto the fused image path (issue 37)."""
import pytest

torchvision = pytest.importorskip("torchvision")

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision import tv_tensors  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402


class Plain(torch.Tensor):
    """A subclass with torch's own __torch_function__: a batch of them stays one."""


class Subclassed(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        image = tv_tensors.Image(torch.full((3, 5, 4), i, dtype=torch.uint8))
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[0, 0, i, i]]), format="XYXY",
                                         canvas_size=(5, 4))
        return {"image": image, "plain": torch.full((2,), float(i)).as_subclass(Plain),
                "mask": tv_tensors.Mask(torch.zeros(2, 2, dtype=torch.bool)), "boxes": boxes,
                "label": i}


def _types(tree):
    return {k: type(v) for k, v in tree.items()}


@pytest.mark.parametrize("batch_size", [3, None])
def test_tensor_subclasses_go_through_slots_and_come_out_as_dataloader_gives_them(batch_size):
    expected = list(DataLoader(Subclassed(), batch_size=batch_size, num_workers=2))
    loader = PooledLoader(Subclassed(), batch_size=batch_size, num_workers=2)
    got = list(loader)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert _types(a) == _types(b)
        for key in ("image", "plain", "mask", "boxes"):
            assert torch.equal(a[key].as_subclass(torch.Tensor), b[key].as_subclass(torch.Tensor))
        assert torch.equal(torch.as_tensor(a["label"]), torch.as_tensor(b["label"]))
        if batch_size is None:  # a subclass with metadata keeps it: it travels DataLoader's way
            assert b["boxes"].canvas_size == a["boxes"].canvas_size
    # image, plain, mask (and, batched, label) leaves went through the slot
    label_bytes = 8 if batch_size else 0  # default_convert leaves a Python int as it is
    assert loader.stats()["bytes_moved"] == 6 * (3 * 5 * 4 + 2 * 4 + 4 + label_bytes)
