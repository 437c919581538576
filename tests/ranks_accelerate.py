"""Run by test_integrations_ranks.py under torch.distributed.run (2 CPU processes): accelerate's
own prepare() on a DataLoader and on the same PooledLoader, and on a WebDataset loader. Writes
OUT/rank{r}.json."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate import Accelerator  # noqa: E402
from loader_datasets import Structured  # noqa: E402
from test_webdataset import sample_id  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.shards.webdataset import WebDataset  # noqa: E402


def main(out, shards):
    acc = Accelerator(cpu=True)
    args = dict(batch_size=4, shuffle=True, num_workers=1)
    ref = DataLoader(Structured(37), generator=torch.Generator().manual_seed(5), **args)
    ours = PooledLoader(Structured(37), generator=torch.Generator().manual_seed(5), **args)
    ref, ours = acc.prepare(ref, ours)
    result = {"rank": acc.process_index, "world": acc.num_processes,
              "inner": type(ours.base_dataloader).__name__, "epochs": []}
    for epoch in range(2):
        ref.set_epoch(epoch)
        ours.set_epoch(epoch)
        a = [b["label"].tolist() for b in ref]
        b = [b["label"].tolist() for b in ours]
        result["epochs"].append({"ref": a, "ours": b})
    wds = acc.prepare(PooledLoader(WebDataset(shards, transform=sample_id, seed=3),
                                   batch_size=4, num_workers=1))
    result["wds_inner"] = type(wds.base_dataloader).__name__
    result["wds"] = [int(i) for b in wds for i in b]
    with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
