"""pooled_loader.ray on a two-node Ray cluster on this machine (issue 48): the UDF runs on the CPU
node, the loader on the trainer node; an actor or a task killed mid-epoch loses no row and
repeats none, and the rows made again are the same rows."""
from __future__ import annotations

import gc
import os
import sys

import pytest

ray = pytest.importorskip("ray")
sys.path.insert(0, os.path.dirname(__file__))

from imgutil import make_folder  # noqa: E402
from ray_pipelines import HERE, MarksActor, quiet_ray  # noqa: E402

from pooled_loader.ray import from_ray, read_image_folder  # noqa: E402


@pytest.fixture(scope="module")
def nodes():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"trainer": 1}, "include_dashboard": False})
    cpu_node = cluster.add_node(num_cpus=2, resources={"cpu_node": 2})
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}}
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR",
             runtime_env=env)
    quiet_ray()
    cluster.wait_for_nodes()
    yield cpu_node.node_id
    gc.collect()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ray_nodes"))
    make_folder(root, n_per_class=16, classes=("ant", "bee"), sizes=((96, 80), (64, 72)))
    return root


def _pipeline(root, on="actors", **udf):
    ds = read_image_folder(root, ray_remote_args={"resources": {"cpu_node": 0.5}})
    if on == "tasks":  # a callable instance: Ray runs it as tasks, retried when they die
        return ds.map_batches(MarksActor(**udf), batch_size=4, resources={"cpu_node": 0.5})
    return ds.map_batches(MarksActor, fn_constructor_kwargs=udf, concurrency=1, batch_size=4,
                          resources={"cpu_node": 1})


def _rows(loader):
    rows = {}
    for batch in loader:
        for r, image, node in zip(batch[0].tolist(), batch[1], batch[2]):
            assert r not in rows, f"row {r} delivered twice"
            rows[r] = (image.clone(), node)
    return rows


def test_the_udf_runs_on_the_cpu_node_and_the_loader_here(nodes, root):
    here = ray.get_runtime_context().get_node_id()
    loader = from_ray(_pipeline(root), batch_size=4, seed=1,
                      columns=("row_id", "image", "node"))
    rows = _rows(loader)
    assert sorted(rows) == list(range(32))
    assert {node for _, node in rows.values()} == {nodes} != {here}


@pytest.mark.parametrize("on", ["actors", "tasks"])
def test_a_killed_actor_or_task_loses_no_row_and_repeats_none(nodes, root, tmp_path, on):
    clean = _rows(from_ray(_pipeline(root, on), batch_size=4, seed=2,
                           columns=("row_id", "image", "node")))
    flag = str(tmp_path / "died")
    killed = _rows(from_ray(_pipeline(root, on, die_at=17, die_flag=flag), batch_size=4, seed=2,
                            columns=("row_id", "image", "node")))
    assert os.path.exists(flag)  # the actor did die mid-epoch
    assert sorted(killed) == sorted(clean) == list(range(32))
    for r in clean:
        assert bool((killed[r][0] == clean[r][0]).all()), f"row {r} differs after the restart"
