"""One rank of the elastic-resume tests (issue 25): saves its first batches and its state, or
resumes from every saved state, and writes what it delivered to a JSON file. Run as real
processes: forked with RANK/WORLD_SIZE set, or spawned as gloo ranks."""
from __future__ import annotations

import itertools
import json
import os

import torch.distributed as dist

from pooled_loader import PooledLoader
from pooled_loader.resume.state import merge_rank_states
from resume_datasets import Noisy


def make(cfg: dict) -> PooledLoader:
    if cfg.get("shards"):  # WebDataset shards (counted mode), split by rank and worker
        from pooled_loader.shards.webdataset import WebDataset
        from test_webdataset import sample_id
        ds = WebDataset(cfg["shards"], transform=sample_id, shuffle_buffer=cfg["buffer"],
                        seed=3)
        return PooledLoader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"])
    return PooledLoader(Noisy(cfg["n"]), batch_size=cfg["batch"], distributed=True, shuffle=True,
                        num_workers=cfg["workers"], drop_last=cfg["drop_last"],
                        per_sample_seed=cfg["per_sample_seed"])


def run(rank: int, world: int, phase: str, workdir: str, cfg: dict) -> None:
    """phase "full": the whole epoch; "save": `cfg["steps"]` batches, then the state; "resume":
    the rest of the epoch from the merged states of the "save" ranks."""
    loader = make(cfg)
    if phase == "resume":
        names = sorted(f for f in os.listdir(workdir) if f.startswith("state_"))
        states = [json.load(open(os.path.join(workdir, f))) for f in names]
        loader.load_state_dict(merge_rank_states(states))
    loader.set_epoch(cfg["epoch"])
    it = iter(loader)
    steps = cfg["steps"] if phase == "save" else None
    got = [[b.tolist(), b.tolist()] if cfg.get("shards") else [b[0].tolist(), b[1].tolist()]
           for b in itertools.islice(it, steps)]
    if phase == "save":
        with open(os.path.join(workdir, f"state_{rank}.json"), "w") as f:
            json.dump(loader.state_dict(), f)
    with open(os.path.join(workdir, f"{phase}_{rank}.json"), "w") as f:
        json.dump({"batches": got, "len": len(loader)}, f)


def forked_rank(rank: int, world: int, phase: str, workdir: str, cfg: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    run(rank, world, phase, workdir, cfg)


def gloo_rank(rank: int, port: int, world: int, phase: str, workdir: str, cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, phase, workdir, cfg)
        dist.barrier()
    finally:
        dist.destroy_process_group()
