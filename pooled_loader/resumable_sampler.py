"""The default shuffled sampler of a resumable loader: torch's RandomSampler, resumable.

``PooledLoader(shuffle=True)`` uses ``ResumableRandomSampler``, which gives the very same order
as torch's ``RandomSampler`` for the same seed or generator, and whose current pass can be saved
(``state_dict()``: where the pass started and how many indices it gave) and replayed without
loading anything. pooled_loader.resume snapshots it in the main process.
"""
from __future__ import annotations

import base64
import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import RandomSampler

from .errors import StateMismatch

__all__ = ["ResumableRandomSampler"]


def _encode_generator(gen: torch.Generator) -> str:
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")


def _decode_generator(text: Any) -> torch.Tensor:
    if isinstance(text, torch.Tensor):  # torchdata's layout keeps the tensor itself
        return text
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class ResumableRandomSampler(RandomSampler):
    """torch's RandomSampler (the very same order for the same seed or generator) whose current
    pass can be saved and replayed: `state_dict()` is {"seed" or "generator", "yielded"}.

    Without a generator each pass draws a 64-bit seed from torch's global RNG, as torch does; with
    one, the pass starts from the generator's state, saved base64-encoded (JSON-friendly). A pass
    starts when `iter()` is called; torch's BatchSampler calls it at its own first `next()`, after
    the loader has drawn its base seed, which keeps DataLoader's order of draws."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start: dict | None = None
        self._yielded = 0
        self._replay: dict | None = None

    def _permutation(self, gen: torch.Generator) -> Iterator[int]:
        n = len(self.data_source)
        if self.replacement:
            for _ in range(self.num_samples // 32):
                yield from torch.randint(high=n, size=(32,), dtype=torch.int64,
                                         generator=gen).tolist()
            yield from torch.randint(high=n, size=(self.num_samples % 32,), dtype=torch.int64,
                                     generator=gen).tolist()
        else:
            for _ in range(self.num_samples // n):
                yield from torch.randperm(n, generator=gen).tolist()
            yield from torch.randperm(n, generator=gen).tolist()[:self.num_samples % n]

    def _begin(self) -> tuple[torch.Generator, int]:
        replay, self._replay = self._replay, None
        if replay is not None:
            self._start = {k: v for k, v in replay.items() if k != "yielded"}
            if "seed" in self._start:
                gen = torch.Generator()
                gen.manual_seed(int(self._start["seed"]))
            else:  # the user's generator continues from the saved state
                gen = self.generator if self.generator is not None else torch.Generator()
                gen.set_state(_decode_generator(self._start["generator"]))
            return gen, int(replay.get("yielded", 0))
        if self.generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            gen = torch.Generator()
            gen.manual_seed(seed)
            self._start = {"seed": seed}
        else:
            gen = self.generator
            self._start = {"generator": _encode_generator(gen)}
        return gen, 0

    def __iter__(self) -> Iterator[int]:
        gen, skip = self._begin()
        indices = self._permutation(gen)
        for _ in itertools.islice(indices, skip):
            pass
        self._yielded = skip
        for index in indices:
            self._yielded += 1
            yield index

    def state_dict(self) -> dict:
        """The current pass: its start (seed or generator state) and how many indices it gave."""
        if self._start is None:
            raise RuntimeError("ResumableRandomSampler.state_dict(): no pass has started yet")
        return {**self._start, "yielded": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        """The next `iter()` replays that pass, after the indices it had already given."""
        if not isinstance(state, dict) or not ({"seed", "generator"} & set(state)):
            raise StateMismatch(f"not a ResumableRandomSampler state: {state!r:.200}")
        self._replay = dict(state)
