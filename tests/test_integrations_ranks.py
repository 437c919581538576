"""Two real ranks (CPU, gloo): Lightning DDP and accelerate keep PooledLoader and cover every
sample once. Each test starts its ranks as separate processes (scripts ranks_*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ranks import free_port
from test_webdataset import make_shards

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RANKS_TIMEOUT_S = 240  # two framework imports per rank on a loaded 2-core machine


def run_ranks(cmd, out, env_extra=None, files="rank{r}.json"):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, HERE, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RANKS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.load(open(os.path.join(out, files.format(r=r)))) for r in range(2)]


@pytest.mark.timeout(RANKS_TIMEOUT_S + 30)
def test_lightning_ddp_keeps_pooled_loader_with_distributed_sampler(tmp_path):
    pytest.importorskip("pytorch_lightning")
    ranks = run_ranks([sys.executable, os.path.join(HERE, "ranks_lightning.py"), str(tmp_path)],
                      str(tmp_path))
    for r in ranks:
        assert r["type"] == "PooledLoader" and r["sampler"] == "DistributedSampler"
        assert r["pool_slots"] == 7 and r["batches"] == 4
        assert len(r["seen"]) == 15
        assert r["undistributed_warnings"] == 0  # Lightning put a DistributedSampler in
    seen = ranks[0]["seen"] + ranks[1]["seen"]
    assert sorted(seen) == list(range(30))  # every sample once


@pytest.mark.timeout(RANKS_TIMEOUT_S + 30)
def test_accelerate_two_processes_shard_like_a_dataloader(tmp_path):
    pytest.importorskip("accelerate")
    shards = tmp_path / "shards"
    make_shards(str(shards), [7, 12, 5, 9])
    out = tmp_path / "out"
    out.mkdir()
    ranks = run_ranks([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                       "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                       os.path.join(HERE, "ranks_accelerate.py"), str(out), str(shards)],
                      str(out))
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    for r in ranks:
        assert r["inner"] == r["wds_inner"] == "PooledLoader"
        for e in r["epochs"]:
            assert e["ours"] == e["ref"]  # accelerate's batches for the equivalent DataLoader
    for epoch in range(2):
        labels = [i for r in ranks for b in r["epochs"][epoch]["ours"] for i in b]
        assert set(labels) == set(range(37))  # sharded: the two ranks together cover all
        assert len(ranks[0]["epochs"][epoch]["ours"]) == len(ranks[1]["epochs"][epoch]["ours"])
    assert ranks[0]["epochs"][0]["ours"] != ranks[0]["epochs"][1]["ours"]
    wds = ranks[0]["wds"] + ranks[1]["wds"]
    assert len(ranks[0]["wds"]) == len(ranks[1]["wds"]) == 16  # 33 // 2 per rank
    assert len(set(wds)) == len(wds) and set(wds) <= set(range(33))


@pytest.mark.timeout(RANKS_TIMEOUT_S + 30)
def test_accelerate_stateful_dispatcher_resumes_exactly_like_stateful_dataloader(tmp_path):
    """use_stateful_dataloader=True, an iterable dataset, 2 processes: accelerate lowers the
    state's top-level counts to undo its look-ahead; PooledLoader honours that. Also: a
    shuffled loader prepared by accelerate does not warn that it is undistributed."""
    pytest.importorskip("accelerate")
    ranks = run_ranks([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                       "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                       os.path.join(HERE, "ranks_accelerate_state.py"), str(tmp_path)],
                      str(tmp_path))
    for r in ranks:
        ref = r["stateful"]
        assert ref["resumed"] == ref["rest"]  # StatefulDataLoader (0 workers) resumes exactly
        for name in ("pooled0", "pooled2"):
            ours = r[name]
            assert ours["inner"] == "PooledLoader"
            assert ours["resumed"] == ours["rest"], name
            assert len(ours["head"]) + len(ours["rest"]) == len(ref["head"]) + len(ref["rest"])
        assert r["pooled0"] == {**ref, "inner": "PooledLoader"}  # the very same batches
        assert r["prepared_warned"] == 0  # accelerate shards it: no false warning
        assert r["raw_warned"] == 1  # an unprepared shuffled loader on 2 ranks: a true one
    labels = sorted(i for r in ranks for b in r["prepared_labels"] for i in b)
    assert set(labels) == set(range(37))
