"""Resume under the stacks users run (issue 36, points 4, 7 and 8): after an elastic WebDataset
resume the next epochs run as they would have; a rank or worker left without data says so; the
accelerate and HF datasets flows resume without losing or repeating batches.

Ranks are set through RANK/WORLD_SIZE (one rank at a time in this process, as torchrun sets
them); workers are real processes; every state goes through a JSON round trip."""
from __future__ import annotations

import itertools
import json
import warnings

import pytest
from test_webdataset import make_shards, sample_id

from pooled_loader import PooledLoader
from pooled_loader.resume.state import merge_rank_states
from pooled_loader.shards.webdataset import WebDataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

SIZES = [9, 14, 5, 11, 8]  # 47 samples


@pytest.fixture
def shards(tmp_path):
    make_shards(str(tmp_path / "s"), SIZES)
    return str(tmp_path / "s")


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b]


class Rank:
    """Loaders of one rank of a world, as torchrun's environment describes it."""

    def __init__(self, monkeypatch, root: str, rank: int, world: int, workers: int = 2,
                 persistent: bool = False) -> None:
        self.mp, self.root, self.rank, self.world = monkeypatch, root, rank, world
        self.workers, self.persistent = workers, persistent

    def loader(self) -> PooledLoader:
        self.mp.setenv("RANK", str(self.rank))
        self.mp.setenv("WORLD_SIZE", str(self.world))
        ds = WebDataset(self.root, transform=sample_id, seed=3)
        return PooledLoader(ds, batch_size=2, num_workers=self.workers,
                            persistent_workers=self.persistent)

    def epoch(self, epoch: int) -> list[int]:
        loader = self.loader()
        loader.set_epoch(epoch)
        return ids(loader)


def save(rank: Rank, epoch: int, steps: int, state: dict | None = None) -> tuple[list, dict]:
    """A fresh loader of `rank` (loading `state`, if given) at `epoch`: its first `steps`
    batches and the state after them."""
    loader = rank.loader()
    if state is not None:
        loader.load_state_dict(state)
    loader.set_epoch(epoch)
    got = ids(itertools.islice(iter(loader), steps))
    return got, roundtrip(loader.state_dict())


@pytest.mark.parametrize("taken", [1, 2])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("old,new", [(1, 1), (2, 1), (2, 3)])
def test_epochs_after_an_elastic_webdataset_resume_run_as_uninterrupted(shards, monkeypatch,
                                                                        persistent, old, new,
                                                                        taken):
    """Point 4: the loader that resumed a merged state goes on to later epochs (set_epoch(1)
    used to raise KeyError: 'position' in the worker), also after a second and third save; the
    second save comes after one batch (a worker has not delivered since the merged load: point 3)
    or two."""
    before, states = [], []
    for r in range(old):
        got, state = save(Rank(monkeypatch, shards, r, old), 0, 2)
        before += got
        states.append(state)
    merged = roundtrip(merge_rank_states(states))
    after = []
    for r in range(new):
        rank = Rank(monkeypatch, shards, r, new, persistent=persistent)
        truth = rank.epoch(1)
        loader = rank.loader()
        loader.load_state_dict(merged)
        loader.set_epoch(0)
        it = iter(loader)
        after += ids(itertools.islice(it, taken))
        second = roundtrip(loader.state_dict())
        after += ids(it)
        loader.set_epoch(1)
        assert ids(loader) == truth  # the same loader, the next epoch
        # the second save (mid resumed epoch), loaded: its third save, loaded: the rest
        got, third = save(rank, 0, 2, second)
        resumed = rank.loader()
        resumed.load_state_dict(third)
        rest = ids(resumed)
        assert got + rest == after[-len(got + rest):]
        resumed.set_epoch(1)
        assert ids(resumed) == truth
    assert len(before + after) == len(set(before + after)), "a sample was read twice"
    assert 47 - len(set(before + after)) < old + new * 2  # only what the splits leave unseen


# -- point 7: a rank or worker left with no data says so ----------------------------------------
def test_a_webdataset_too_small_for_its_ranks_warns_naming_the_counts(tmp_path, monkeypatch):
    make_shards(str(tmp_path), [3])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match=r"3 samples in 1 shard\(s\) over 4 rank\(s\): every "
                                         r"rank reads 0 samples"):
        ds = WebDataset(str(tmp_path), transform=sample_id)
    assert len(ds) == 0 and list(PooledLoader(ds, batch_size=2, num_workers=2)) == []


def test_workers_left_without_samples_warn_in_the_main_process(tmp_path, monkeypatch):
    make_shards(str(tmp_path), [3])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = PooledLoader(WebDataset(str(tmp_path), transform=sample_id), batch_size=2,
                          num_workers=2)
    with pytest.warns(UserWarning, match=r"3 samples in 1 shard\(s\) over 2 rank\(s\), 1 per "
                                         r"rank, and 2 workers per rank: 1 worker\(s\) of each "
                                         r"rank read nothing. Use num_workers=1"):
        assert ids(loader) == [0]
    monkeypatch.setenv("WORLD_SIZE", "1")
    loader = PooledLoader(WebDataset(str(tmp_path), transform=sample_id), batch_size=2,
                          num_workers=2, drop_last=True)
    with warnings.catch_warnings():  # pieces of 2 and 1: one batch is kept, no warning
        warnings.simplefilter("error", UserWarning)
        assert ids(loader) == [0, 1]
    loader = PooledLoader(WebDataset(str(tmp_path), transform=sample_id), batch_size=4,
                          num_workers=2, drop_last=True)
    with pytest.warns(UserWarning, match=r"with batch_size=4 and drop_last=True every worker's "
                                         r"batch is dropped \(0 batches\)"):
        assert ids(loader) == []


def test_map_style_ranks_and_batches_left_empty_by_drop_last_warn(monkeypatch):
    from resume_datasets import Noisy
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    loader = PooledLoader(Noisy(3), batch_size=2, distributed=True, drop_last=True)
    with pytest.warns(UserWarning, match=r"3 samples over 4 rank\(s\) with drop_last=True: every "
                                         r"rank gets 3 // 4 = 0 samples"):
        assert list(loader) == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"3 samples: with batch_size=4 and drop_last=True the "
                                         r"epoch has 0 batches"):
        assert list(PooledLoader(Noisy(3), batch_size=4, drop_last=True, num_workers=1)) == []
    with warnings.catch_warnings():  # padded by repetition: every rank has a sample
        warnings.simplefilter("error", UserWarning)
        monkeypatch.setenv("WORLD_SIZE", "4")
        assert len(list(PooledLoader(Noisy(3), batch_size=2, distributed=True))) == 1


# -- point 8: accelerate and HF datasets --------------------------------------------------------
@pytest.mark.timeout(2 * 240 + 60)
def test_accelerate_shuffled_resume_in_new_processes_continues_the_saved_epoch(tmp_path):
    """accelerate's issue 4195 (a resume in new processes replayed epoch 0's permutation at the
    saved position) and its stale state_dict() right after load_state_dict() (point 8a): 2
    processes, 0 and 2 workers; the resumed run, and the states saved right after the load and
    one batch later, give the uninterrupted run's batches."""
    pytest.importorskip("accelerate")
    import os
    import sys

    from ranks import free_port
    from test_integrations_ranks import HERE, run_ranks

    def launch(phase):
        run_ranks([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                   os.path.join(HERE, "ranks_accelerate_resume.py"), phase, str(tmp_path)],
                  str(tmp_path), files=f"{phase}-rank{{r}}.json")
    launch("save")
    launch("resume")
    for rank in range(2):
        saved = json.load(open(tmp_path / f"save-rank{rank}.json"))
        resumed = json.load(open(tmp_path / f"resume-rank{rank}.json"))
        for workers in ("0", "2"):
            truth, got = saved[workers], resumed[workers]
            assert truth["epoch0"] != truth["head"] + truth["rest"]  # epochs differ
            assert got["rest"] == truth["rest"], (rank, workers)
            assert got["epoch2"] == truth["epoch2"], (rank, workers)
            assert got["from_second"] == truth["rest"], (rank, workers)
            assert got["from_third"] == truth["rest"][1:], (rank, workers)
            assert got["third_after"] == truth["epoch2"], (rank, workers)


@pytest.mark.timeout(2 * 240 + 60)
def test_accelerate_seedable_sampler_resumed_in_new_processes_gives_the_uninterrupted_run(
        tmp_path):
    """accelerate issue 4195 with use_seedable_sampler=True (issue 45 item 5): its permutation is
    seed + accelerate's epoch counter, which a new process restarts at 0, so a state saved in
    epoch 1 resumed epoch 0's permutation at the saved position, and an epoch's end state (or a
    last-step one, which accelerate marks finished) gave the next epoch's permutation twice (on
    rank 0 of 2, 11 of the next 60 items lost). Every variant (state_dict with and without
    use_stateful_dataloader, save_state/load_state, skip_first_batches; one process and a
    simulated rank 0 of 2; mid-epoch, inside the last step, after the loop) resumed in a new
    process gives the uninterrupted run's batches, in its order, for three passes."""
    pytest.importorskip("accelerate")
    import os
    import subprocess
    import sys

    from test_integrations_ranks import HERE, REPO, RANKS_TIMEOUT_S
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (REPO, HERE, os.environ.get("PYTHONPATH")) if p)}
    for phase in ("save", "resume"):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "accelerate_seedable_resume.py"),
                               phase, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=RANKS_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-5000:]
    saved = json.load(open(tmp_path / "save.json"))
    resumed = json.load(open(tmp_path / "resume.json"))

    def flat(batches):
        return [i for b in batches for i in b]
    assert len(saved) == 24
    for variant, run in saved.items():
        e = int(variant.split("-")[-1])
        truth, steps = run["truth"][e:], len(run["head"])
        assert run["head"] == truth[0][:steps], variant  # the saving run is the uninterrupted one
        want = [p for p in (truth[0][steps:], *truth[1:]) if p][:3]
        got = [p for p in resumed[variant] if p]
        lost = [len(set(flat(w)) - set(flat(g))) for w, g in zip(want, got)]
        assert got == want, (variant, f"items lost in each pass: {lost}")


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True)])
def test_hf_iterable_resumed_without_set_epoch_warns_and_set_epoch_gives_full_epochs(
        workers, persistent):
    """Point 8c: datasets.IterableDataset restarts from a loaded state at every pass of that
    epoch; kept in one process (0 or persistent workers) every later epoch was the short rest
    (StatefulDataLoader too). We warn once with the fix, and the fix gives the uninterrupted
    epochs."""
    datasets = pytest.importorskip("datasets")
    from torchdata.stateful_dataloader import StatefulDataLoader
    table = datasets.Dataset.from_dict({"x": list(range(256))}).with_format("torch")

    def make(cls=PooledLoader):
        return cls(table.to_iterable_dataset(num_shards=4), batch_size=4, num_workers=workers,
                   persistent_workers=persistent)

    def batches(loader):
        return [b["x"].tolist() for b in loader]
    uninterrupted = make()  # set_epoch each epoch, as the fix says
    truths = []
    for epoch in range(3):
        uninterrupted.set_epoch(epoch)
        truths.append(batches(uninterrupted))
    truth = truths[0]
    saver = make()
    it = iter(saver)
    for _ in range(61):
        next(it)
    state = roundtrip(saver.state_dict())
    del it
    sdl = make(StatefulDataLoader)
    it = iter(sdl)
    for _ in range(61):
        next(it)
    theirs = make(StatefulDataLoader)
    theirs.load_state_dict(sdl.state_dict())
    del it
    assert [len(batches(theirs)) for _ in range(2)] == [3, 3]  # StatefulDataLoader: short
    loader = make()
    loader.load_state_dict(state)
    assert batches(loader) == truth[61:]
    with pytest.warns(UserWarning, match=r"set_epoch\(epoch\) before each epoch"):
        assert len(batches(loader)) == 3  # the dataset's own rule, now said
    fixed = make()
    fixed.load_state_dict(state)
    got = []
    for epoch in range(3):
        fixed.set_epoch(epoch)
        got.append(batches(fixed))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert got == [truth[61:], *truths[1:]]
