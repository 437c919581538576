"""The key names of a loader state (`PooledLoader.state_dict()`), shared by `resume` (which
writes and reads states) and `elastic` (which merges the states of several ranks)."""

FORMAT = "pooled_loader.resume/1"

# torchdata StatefulDataLoader's key names (stateful_dataloader.py), reused so that both layouts
# read alike; see docs/resume.md for what is and is not interchangeable.
SNAPSHOT = "_snapshot"
SNAPSHOT_STEP = "_snapshot_step"
STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"
ITERATOR_FINISHED = "_iterator_finished"
LAST_YIELDED_WORKER_ID = "_last_yielded_worker_id"
MAIN_SNAPSHOT = "_main_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
NUM_WORKERS = "_num_workers"
INDEX_SAMPLER_STATE = "_index_sampler_state"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
BASE_SEED = "_base_seed"
WORKER_ID = "worker_id"
DATASET_STATE = "dataset_state"
FETCHER_STATE = "fetcher_state"
DATASET_ITER_STATE = "dataset_iter_state"
FETCHER_ENDED = "fetcher_ended"
POOLED = "_pooled"  # ours; its keys:
FORMAT_KEY = "format"  # FORMAT
STARTED = "started"  # False: saved by an older version before any iter()
SEED_EPOCH = "epoch"  # the epoch per-sample seeds are drawn for (the iterator's own count)
LOADER_EPOCH = "loader_epoch"  # the loader's last set_epoch() (None: never called)
SAMPLER_EPOCH = "sampler_epoch"  # the own epoch of the sampler that picks the order
SAMPLER_SNAPSHOT_STEP = "sampler_snapshot_step"  # where the saved sampler state was taken
DELIVERED_AHEAD = "delivered_ahead"  # positions delivered past the prefix (in_order=False)
RNG_CHECK = "rng_check"  # `seeds.rng_fingerprint` of the base seeds' RNG when saved
ELASTIC = "elastic"  # an ElasticDistributedSampler's epoch, seed, shuffle and plan
# StatefulDataLoader's keys that ours carries for tools but does not read back
NUM_YIELDED = "_num_yielded"
SAMPLER_ITER_STATE = "_sampler_iter_state"
SHARED_SEED = "_shared_seed"
LEN_CALLED = "_IterableDataset_len_called"
