#!/usr/bin/env python
"""Train a small CNN on an ImageFolder with PooledLoader (the one-line swap from DataLoader).

    python examples/train_classifier.py DATA_DIR [--epochs 2] [--batch 64] [--workers 2]
                                        [--device cpu|cuda] [--max-steps N]

Make data with: python scripts/tools/make_dataset.py data/demo --n 512
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn
from tqdm import tqdm

from pooled_loader import PooledLoader  # was: from torch.utils.data import DataLoader
from pooled_loader.cuda import NormalizeImages
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                  RandomResizedCrop, ToCHW)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def small_cnn(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))
    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch early")
    args = parser.parse_args(argv)

    dataset = ImageFolder(args.data, transform=Compose([
        DecodeImage(), RandomResizedCrop(args.size), RandomHorizontalFlip(), ToCHW()]))
    # uint8 batches travel; normalisation to float runs after the transfer (on the GPU if any).
    loader = PooledLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                          persistent_workers=args.workers > 0, drop_last=True,
                          device=args.device if args.device.startswith("cuda") else None,
                          device_transform=NormalizeImages(MEAN, STD))
    device = torch.device(args.device)
    model = small_cnn(len(dataset.classes)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        model.train()
        seen, correct, start = 0, 0, time.perf_counter()
        bar = tqdm(loader, desc=f"epoch {epoch}", unit="batch")
        for step, (images, labels) in enumerate(bar):
            images, labels = images.to(device), labels.to(device)
            logits = model(images)
            loss = loss_fn(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{correct / seen:.2f}",
                            img_s=f"{seen / (time.perf_counter() - start):.0f}")
            if args.max_steps and step + 1 >= args.max_steps:
                break
    print(loader.report())
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
