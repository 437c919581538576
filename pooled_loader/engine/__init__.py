"""The loader's machinery: the shared-memory slot pool and its size classes (pool, size_classes),
the messages between processes (messages), a batch's layout in a slot (layout, columns), the
default collate into a slot (slot_collate, mismatch), the worker (worker), the iterators of an
epoch (epoch, iterators, worker_iter, processes, interrupts) and the copy to the GPU (cuda).

Imports core/, observability/ and resume/."""
