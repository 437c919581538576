"""Stand-ins for the ``RandomMixUp``/``RandomCutMix`` classes of torchvision's reference
classification script (``references/classification/transforms.py``, not importable), written
here from their described behaviour: clone unless ``inplace``; one-hot targets in the batch's
dtype; a ``p`` coin compared in float64; lambda from a (2,) Dirichlet; MixUp ``rolled * (1 -
lam) + own * lam``; CutMix a box of the rolled batch, lambda then the box's share."""
import math

import torch


class RandomMixUp(torch.nn.Module):
    """Stands for the reference script's class: written here from its described behaviour."""

    def __init__(self, num_classes: int, p: float = 0.5, alpha: float = 1.0,
                 inplace: bool = False) -> None:
        super().__init__()
        self.num_classes, self.p, self.alpha, self.inplace = num_classes, p, alpha, inplace

    def _start(self, batch, target):
        if not self.inplace:
            batch, target = batch.clone(), target.clone()
        target = torch.nn.functional.one_hot(target, num_classes=self.num_classes)
        return batch, target.to(dtype=batch.dtype)

    def _lam(self) -> float:
        return float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])

    @staticmethod
    def _mix_targets(target, lam):
        rolled = target.roll(1, 0)
        rolled.mul_(1.0 - lam)
        return target.mul_(lam).add_(rolled)

    def forward(self, batch, target):
        batch, target = self._start(batch, target)
        if torch.rand(1).item() >= self.p:
            return batch, target
        lam = self._lam()
        rolled = batch.roll(1, 0)
        rolled.mul_(1.0 - lam)
        batch.mul_(lam).add_(rolled)
        return batch, self._mix_targets(target, lam)


class RandomCutMix(RandomMixUp):
    def forward(self, batch, target):
        batch, target = self._start(batch, target)
        if torch.rand(1).item() >= self.p:
            return batch, target
        lam = self._lam()
        rolled = batch.roll(1, 0)
        height, width = batch.shape[-2:]
        r_x, r_y = torch.randint(width, (1,)), torch.randint(height, (1,))
        r = 0.5 * math.sqrt(1.0 - lam)
        half_w, half_h = int(r * width), int(r * height)
        x1, y1 = int(torch.clamp(r_x - half_w, min=0)), int(torch.clamp(r_y - half_h, min=0))
        x2 = int(torch.clamp(r_x + half_w, max=width))
        y2 = int(torch.clamp(r_y + half_h, max=height))
        batch[:, :, y1:y2, x1:x2] = rolled[:, :, y1:y2, x1:x2]
        lam = float(1.0 - (x2 - x1) * (y2 - y1) / (width * height))
        return batch, self._mix_targets(target, lam)
