"""Exceptions shared by the loader and the datasets it feeds."""


class SampleError(Exception):
    """A sample could not be produced: the message names the sample (file, shard/key) and why.

    With ``on_error="skip"`` the loader skips samples whose loading raised this (or any other
    exception) and counts them in ``loader.stats()``.
    """


class WorkerError(RuntimeError):
    """A worker process died or stopped answering."""


class ClassMismatchError(ValueError):
    """Two datasets (an ImageFolder and shards or a cache made from a folder) number their
    classes differently, so the same label would mean different classes."""
