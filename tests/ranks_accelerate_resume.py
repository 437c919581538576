"""Run by test_resume_stacks.py under torch.distributed.run (2 CPU processes), twice: "save"
runs a shuffled PooledLoader prepared by accelerate (use_stateful_dataloader=True) through
epoch 0 and 2 batches of epoch 1, saves its state, and records the uninterrupted rest (epochs 1
and 2); "resume" (new processes) loads that state, saves at once (accelerate's stale copy,
issue 36 point 8a), runs the rest, then loads that second state and a third saved one batch
later. Writes OUT/<phase>-rank{r}.json and OUT/state-w{workers}-rank{r}.json."""

import json
import os
import sys

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402

N = 40


class Index(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i)


def prepared(acc, workers):
    return acc.prepare(PooledLoader(Index(), batch_size=2, shuffle=True, num_workers=workers))


def epoch(loader, steps=None):
    out = []
    for b in loader:
        out.append(b.tolist())
        if steps is not None and len(out) == steps:
            break
    return out


def main(phase, out):
    set_seed(0)  # as a training script does, before building anything
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    rank = acc.process_index
    result = {}
    for workers in (0, 2):
        path = os.path.join(out, f"state-w{workers}-rank{rank}.json")
        loader = prepared(acc, workers)
        if phase == "save":
            first = epoch(loader)
            it = iter(loader)
            head = [next(it).tolist() for _ in range(2)]
            with open(path, "w") as f:
                json.dump(loader.state_dict(), f)
            rest = [b.tolist() for b in it]
            result[workers] = {"epoch0": first, "head": head, "rest": rest,
                               "epoch2": epoch(loader)}
            continue
        with open(path) as f:
            loader.load_state_dict(json.load(f))
        second = json.loads(json.dumps(loader.state_dict()))  # right after the load
        rest, after = epoch(loader), epoch(loader)
        again = prepared(acc, workers)
        again.load_state_dict(second)
        it = iter(again)
        one = [next(it).tolist()]
        third = json.loads(json.dumps(again.state_dict()))
        from_second = one + [b.tolist() for b in it]
        last = prepared(acc, workers)
        last.load_state_dict(third)
        result[workers] = {"rest": rest, "epoch2": after, "from_second": from_second,
                           "from_third": epoch(last), "third_after": epoch(last)}
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
