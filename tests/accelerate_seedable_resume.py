"""Run by test_resume_stacks.py in new processes, twice (issue 45 item 5, accelerate issue 4195):
accelerate's use_seedable_sampler=True over a shuffled PooledLoader, 0 workers, one process or
a simulated rank 0 of 2. "save" runs every variant uninterrupted (epochs 0-4) and again to a
save point (mid-epoch, inside the epoch's last step, or after its loop ended), saving there;
"resume" (a new process) rebuilds, loads and runs three passes. Writes OUT/<phase>.json:
{variant: {"truth", "head"} or the resumed passes}."""

import json
import os
import sys

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accelerate.data_loader as adl  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402

N, BATCH, MID = 60, 4, 5
# (how, use_stateful_dataloader, processes, where, the saved epoch)
VARIANTS = [(how, stateful, ranks, where, epoch)
            for how, stateful in (("state_dict", False), ("state_dict", True),
                                  ("save_state", True))
            for ranks in (1, 2) if not (how == "save_state" and ranks == 2)
            for where, epoch in (("mid", 1), ("last", 1), ("end", 1), ("end", 0))]
VARIANTS += [("skip_first_batches", False, ranks, "mid", epoch)
             for ranks in (1, 2) for epoch in (0, 1)]


class Index(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i)


def name(variant):
    return "-".join(map(str, variant))


def build(variant):
    """A new Accelerator and its prepared loader, as a training script starts."""
    _, stateful, ranks, _, _ = variant
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, use_stateful_dataloader=stateful))
    loader = PooledLoader(Index(), batch_size=BATCH, shuffle=True)
    if ranks == 1:
        return acc, acc.prepare(loader)
    return acc, adl.prepare_data_loader(loader, num_processes=ranks, process_index=0,
                                        put_on_device=False, use_seedable_sampler=True,
                                        use_stateful_dataloader=stateful)


def batches(loader):
    return [b.tolist() for b in loader]


def save(variant, out):
    how, _, _, where, epoch = variant
    _, loader = build(variant)
    truth = [batches(loader) for _ in range(epoch + 4)]
    acc, loader = build(variant)
    for _ in range(epoch):
        batches(loader)
    it = iter(loader)
    steps = MID if where == "mid" else len(truth[epoch])
    head = [next(it).tolist() for _ in range(steps)]
    if where == "end":
        assert next(it, None) is None
    path = os.path.join(out, name(variant))
    if how == "save_state":
        acc.save_state(path)
    elif how == "state_dict":
        with open(path + ".json", "w") as f:
            json.dump(loader.state_dict(), f)
    if where == "last":
        assert next(it, None) is None
    return {"truth": truth, "head": head}


def resume(variant, out):
    how, _, _, _, epoch = variant
    acc, loader = build(variant)
    path = os.path.join(out, name(variant))
    if how == "skip_first_batches":  # transformers' Trainer: set_epoch, then skip
        loader.set_epoch(epoch)
        passes = [batches(acc.skip_first_batches(loader, MID))]
        for later in (epoch + 1, epoch + 2):
            loader.set_epoch(later)
            passes.append(batches(loader))
        return passes
    if how == "save_state":
        acc.load_state(path)
    else:
        with open(path + ".json") as f:
            loader.load_state_dict(json.load(f))
    return [batches(loader) for _ in range(3)]


def main(phase, out):
    run = save if phase == "save" else resume
    result = {name(v): run(v, out) for v in VARIANTS}
    with open(os.path.join(out, f"{phase}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
