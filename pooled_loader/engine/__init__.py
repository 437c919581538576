"""The loader's machinery: the shared-memory slot pool and its size classes (pool, size_classes),
the messages between processes (messages), a batch's layout in a slot (layout, columns), the
default collate into a slot (slot_collate, mismatch), the worker (worker), the iterators of an
epoch (epoch, iterators, worker_iter, processes, interrupts), where an epoch stands (position)
with the default shuffled sampler (sampler), and the copy to the GPU (cuda).

Imports core/ and observability/ only: no dataset (a dataset's say goes through `core.hooks`)
and no checkpoint format (`resume/` turns `position.EpochPosition` into a state and back)."""
