"""The default shuffled sampler of a resumable loader: torch's RandomSampler, resumable.

``PooledLoader(shuffle=True)`` uses ``ResumableRandomSampler``, which gives the very same order
as torch's ``RandomSampler`` for the same seed or generator, and whose current pass can be saved
(``state_dict()``: where the pass started and how many indices it gave) and replayed without
loading anything. The main process snapshots it (`position.SamplerCursor`); it lives beside
the machinery that advances the epoch, and `pooled_loader.resume` re-exports it (its public path).
"""
from __future__ import annotations

import base64
import itertools
import operator
from typing import Any, Iterator

import torch
from torch.utils.data import RandomSampler

from ..core.errors import StateMismatch
from ..core.state_checks import StateChecks

__all__ = ["ResumableRandomSampler"]


def encode_generator(state: torch.Tensor) -> str:
    """A generator's state (`Generator.get_state()`, as torchdata's samplers save it) as the
    JSON-friendly text of our states."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _encode_generator(gen: torch.Generator) -> str:
    return encode_generator(gen.get_state())


_GENERATOR_BYTES = torch.Generator().get_state().numel()  # a CPU generator's state


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
        self._given = 0  # indices given by the lists of the current pass before `_current`
        self._current: Iterator[int] | None = None
        self._current_len = 0
        self._replay: dict | None = None

    def _chunks(self, gen: torch.Generator) -> Iterator[list[int]]:
        """The pass's indices as torch's RandomSampler draws them: a list per draw, each drawn
        when the indices before it are used up."""
        n = len(self.data_source)
        if self.replacement:
            for _ in range(self.num_samples // 32):
                yield torch.randint(high=n, size=(32,), dtype=torch.int64, generator=gen).tolist()
            yield torch.randint(high=n, size=(self.num_samples % 32,), dtype=torch.int64,
                                generator=gen).tolist()
        else:
            for _ in range(self.num_samples // n):
                yield torch.randperm(n, generator=gen).tolist()
            yield torch.randperm(n, generator=gen).tolist()[:self.num_samples % n]

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

    def _lists(self) -> Iterator[Iterator[int]]:
        """The pass (started at the first index asked for), as one iterator per drawn list."""
        gen, skip = self._begin()
        self._given, self._current = 0, None
        for chunk in self._chunks(gen):
            if skip >= len(chunk):
                skip -= len(chunk)
                self._given += len(chunk)
                continue
            self._given += skip
            self._current, self._current_len = iter(chunk[skip:]), len(chunk) - skip
            skip = 0
            yield self._current
            self._given += self._current_len
            self._current = None

    @property
    def _yielded(self) -> int:
        """How many indices the current pass has given (the current list's iterator knows how
        many it has left)."""
        if self._current is None:
            return self._given
        return self._given + self._current_len - operator.length_hint(self._current)

    def __iter__(self) -> Iterator[int]:
        # chained lists: each index costs no Python frame (a generator per index cost ~5 us a
        # batch of 64, more than DataLoader's whole sampler)
        return itertools.chain.from_iterable(self._lists())

    def state_dict(self) -> dict:
        """The current pass: its start (seed or generator state) and how many indices it gave."""
        if self._start is None:
            raise RuntimeError("ResumableRandomSampler.state_dict(): no pass has started yet")
        return {**self._start, "yielded": self._yielded}

    def check_state_dict(self, state: Any, checks: StateChecks | None = None) -> None:
        """Raise ValueError naming the key unless `state` is a pass of this sampler: a 64-bit
        seed or a generator state, and at most `num_samples` indices given (`checks`: how to
        name the keys, e.g. under the loader's state)."""
        c = checks or StateChecks("ResumableRandomSampler.load_state_dict: the state")
        if not isinstance(state, dict) or not ({"seed", "generator"} & set(state)):
            raise StateMismatch(f"{c.where}: not a ResumableRandomSampler state (no seed or "
                                f"generator): {state!r:.200}")
        if "seed" in state:
            c.seed_value(state["seed"], "seed")
        else:
            try:
                size = _decode_generator(state["generator"]).numel()
            except (AttributeError, TypeError, ValueError):
                size = None
            if size != _GENERATOR_BYTES:
                raise c.bad("generator", f"should be a torch.Generator state "
                            f"({_GENERATOR_BYTES} bytes, base64), got {state['generator']!r:.80}")
        if "yielded" in state:
            c.count_value(state["yielded"], "yielded", self.num_samples,
                          " (the indices of one pass)")

    def load_state_dict(self, state: dict) -> None:
        """The next `iter()` replays that pass, after the indices it had already given."""
        self.check_state_dict(state)
        self._replay = dict(state)
