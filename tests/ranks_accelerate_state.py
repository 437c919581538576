"""Run by test_integrations_ranks.py under torch.distributed.run (2 CPU processes):
accelerate's use_stateful_dataloader=True over an iterable dataset (its DataLoaderDispatcher),
saved mid-epoch and resumed, for StatefulDataLoader and PooledLoader; and whether a shuffled
PooledLoader warns that it is undistributed. Writes OUT/rank{r}.json."""

import json
import os
import sys
import warnings

import torch
from torch.utils.data import IterableDataset, get_worker_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402
from loader_datasets import Structured  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402

N = 44
UNDISTRIBUTED = "every rank will iterate over the whole dataset"


class Count(IterableDataset):
    """0..N-1, split between a loader's workers."""

    def __iter__(self):
        info = get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return (torch.tensor(i) for i in range(first, N, step))


def saved_and_resumed(acc, make):
    prepared = acc.prepare(make())
    it = iter(prepared)
    head = [next(it).tolist() for _ in range(3)]
    state = prepared.state_dict()
    rest = [b.tolist() for b in it]
    again = acc.prepare(make())
    again.load_state_dict(state)
    return {"head": head, "rest": rest, "resumed": [b.tolist() for b in again],
            "inner": type(prepared.base_dataloader).__name__}


def main(out):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    result = {"rank": acc.process_index}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = acc.prepare(PooledLoader(Structured(37), batch_size=4, shuffle=True))
        result["prepared_labels"] = [b["label"].tolist() for b in prepared]
        result["prepared_warned"] = sum(UNDISTRIBUTED in str(w.message) for w in caught)
        for _ in PooledLoader(Structured(8), batch_size=4, shuffle=True):  # truly undistributed
            pass
        result["raw_warned"] = sum(UNDISTRIBUTED in str(w.message) for w in caught)
    result["stateful"] = saved_and_resumed(acc, lambda: StatefulDataLoader(Count(),
                                                                           batch_size=4))
    for workers in (0, 2):
        result[f"pooled{workers}"] = saved_and_resumed(
            acc, lambda: PooledLoader(Count(), batch_size=4, num_workers=workers))
    with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
