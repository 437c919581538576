"""Run by test_integrations_ranks.py: Lightning DDP (2 CPU ranks, gloo) over a PooledLoader built
in train_dataloader(). Lightning starts rank 1 by running this script again. Writes
OUT/rank{r}.json with what each rank saw."""

import json
import os
import sys
import warnings

import torch
from torch.utils.data import Dataset

import pytorch_lightning as pl
from pooled_loader import PooledLoader

N = 30


class Indexed(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((2,), float(i)), i


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.seen = []
        self.loader_info = {}

    def train_dataloader(self):
        return PooledLoader(Indexed(), batch_size=4, shuffle=True, num_workers=1, pool_slots=7)

    def training_step(self, batch, _):
        x, idx = batch
        self.seen += [int(i) for i in idx]
        return self.lin(x).sum() * 0.0

    def on_train_epoch_end(self):
        dl = self.trainer.train_dataloader
        self.loader_info = {"type": type(dl).__name__, "sampler": type(dl.sampler).__name__,
                            "pool_slots": dl.pool_slots, "batches": dl.stats()["batches"]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main(out):
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    undistributed = sum("every rank will iterate" in str(w.message) for w in caught)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"seen": model.seen, "undistributed_warnings": undistributed,
                   **model.loader_info}, f)


if __name__ == "__main__":
    main(sys.argv[1])
