"""Ray pipelines and ranks shared by the pooled_loader.ray tests (run in test processes, in
spawned gloo ranks, and in Ray's workers, which import this module by name)."""
from __future__ import annotations

import json
import os
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def quiet_ray() -> None:
    import ray.data
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def init_ray(**kwargs) -> None:
    """Ray for a test process: this folder importable by Ray's workers, logs kept out."""
    import ray
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}}
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env=env, **kwargs)
    quiet_ray()


class Marks:
    """A light UDF (no decoding): each row's "image" is a function of (row id, epoch, its bytes'
    CRC), and every row it makes is appended to `log_dir/<pid>.log` (what Ray decoded)."""

    def __init__(self, log_dir: str | None = None, die_at: int | None = None,
                 die_flag: str | None = None) -> None:
        self.log_dir, self.die_at, self.die_flag = log_dir, die_at, die_flag

    def __call__(self, batch: dict) -> dict:
        rows, epochs = batch["row_id"], batch["epoch"]
        n = len(rows)
        image = np.empty((n, 3, 4, 4), np.float32)
        for i in range(n):
            crc = zlib.crc32(bytes(batch["bytes"][i]))
            image[i] = (int(rows[i]) * 7 + int(epochs[i]) * 1000 + crc % 97)
        if self.die_at is not None and self.die_at in rows.tolist() and \
                not os.path.exists(self.die_flag):
            open(self.die_flag, "w").close()
            os._exit(1)  # the actor dies mid-epoch, once
        if self.log_dir:
            with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a") as f:
                f.write("".join(f"{int(e)} {int(r)}\n" for r, e in zip(rows, epochs)))
        return {"row_id": rows, "epoch": epochs, "image": image, "label": batch["label"]}


def decoded(log_dir: str) -> list[tuple[int, int]]:
    """(epoch, row id) of every row the Marks UDFs made, in no particular order."""
    out = []
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            out += [tuple(int(v) for v in line.split()) for line in f if line.strip()]
    return out


def pipeline(root: str, log_dir: str | None = None, **udf_kwargs):
    from pooled_loader.ray import read_image_folder
    return read_image_folder(root).map_batches(Marks(log_dir, **udf_kwargs), batch_size=8)


def ids_of(loader, limit: int | None = None) -> list[list[int]]:
    """The row ids of the loader's batches: all of the epoch, or the first `limit` (no more is
    drawn: a batch drawn counts as delivered)."""
    import itertools
    return [batch["row_id"].tolist() for batch in itertools.islice(iter(loader), limit)]


# -- gloo ranks ----------------------------------------------------------------------------------
def gloo_rank(rank: int, port: int, world: int, address: str, root: str, workdir: str,
              phase: str, steps: int) -> None:
    """One trainer rank: "full" runs the epoch, "save" `steps` batches then its state, "resume"
    the rest from the merged states of the "save" ranks. Writes its batches' row ids."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, HERE)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        init_ray(address=address)
        from pooled_loader.ray import from_ray
        from pooled_loader.resume import merge_rank_states
        loader = from_ray(pipeline(root), batch_size=4, distributed=True, seed=5)
        if phase == "resume":
            names = sorted(f for f in os.listdir(workdir) if f.startswith("state_"))
            loader.load_state_dict(merge_rank_states(
                [json.load(open(os.path.join(workdir, f))) for f in names]))
        else:
            loader.set_epoch(1)
        got = ids_of(loader, steps if phase == "save" else None)
        if phase == "save":
            with open(os.path.join(workdir, f"state_{rank}.json"), "w") as f:
                json.dump(loader.state_dict(), f)
        figures = loader.stats()["ray"]
        with open(os.path.join(workdir, f"{phase}_{rank}.json"), "w") as f:
            json.dump({"batches": got, "padded": figures["padded_rows"]}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


class MarksActor(Marks):
    """Marks as a class-based UDF (Ray runs it in actors), with the node each row was made on."""

    def __call__(self, batch: dict) -> dict:
        import ray
        out = super().__call__(batch)
        out["node"] = np.array([ray.get_runtime_context().get_node_id()] * len(out["row_id"]))
        return out


def train_loop(config: dict) -> None:
    """A Ray Train worker (TorchTrainer): this rank's rows through Ray Train's shard, and
    through from_ray(ds, distributed=True) over the Dataset itself."""
    import ray.train
    import torch.distributed as dist
    from pooled_loader.ray import from_ray
    rank = ray.train.get_context().get_world_rank()
    shard = ray.train.get_dataset_shard("train")
    out = {"group": dist.is_initialized(),
           "shard": [i for b in ids_of(from_ray(shard, batch_size=4)) for i in b],
           "own": [i for b in ids_of(from_ray(config["ds"], batch_size=4, distributed=True,
                                               seed=config["seed"])) for i in b]}
    with open(os.path.join(config["out"], f"train_{rank}.json"), "w") as f:
        json.dump(out, f)
