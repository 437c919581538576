"""Lightning in one process: its checkpoint carries PooledLoader's state, and a run resumed from
a mid-epoch checkpoint sees exactly the rest of the epoch."""

from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch
from torch.utils.data import Dataset

from pooled_loader import PooledLoader

pl = pytest.importorskip("pytorch_lightning")
pytestmark = pytest.mark.skipif(not hasattr(PooledLoader, "state_dict"),
                                reason="PooledLoader.state_dict is not in this version")


class Indexed(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((2,), float(i)), i


class Recorder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.seen = []

    def training_step(self, batch, _):
        x, idx = batch
        self.seen.append([int(i) for i in idx])
        return self.lin(x).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def loader():
    return PooledLoader(Indexed(), batch_size=4, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(3))


def fit(model, ckpt_path=None, **kwargs):
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


def test_lightning_checkpoint_and_resume_carry_the_loader_state(tmp_path):
    full = Recorder()
    fit(full, max_epochs=1, enable_checkpointing=False)
    assert len(full.seen) == 10 and sorted(i for b in full.seen for i in b) == list(range(40))

    first = Recorder()
    ckpts = str(tmp_path / "ckpt")
    fit(first, max_epochs=1, callbacks=[pl.callbacks.ModelCheckpoint(
        dirpath=ckpts, every_n_train_steps=4, save_top_k=-1)])
    at_step_4 = [p for p in glob.glob(os.path.join(ckpts, "*.ckpt")) if "step=4" in p]
    assert len(at_step_4) == 1
    saved = torch.load(at_step_4[0], weights_only=False)
    states = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(states) == 1 and states[0]  # the loader's state is in the checkpoint

    resumed = Recorder()
    fit(resumed, ckpt_path=at_step_4[0], max_epochs=1, enable_checkpointing=False)
    assert first.seen[:4] + resumed.seen == full.seen  # the rest of the epoch, nothing twice
