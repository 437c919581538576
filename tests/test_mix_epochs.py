"""pooled_loader.mix across epochs and ranks: persistent workers follow `set_weights`, and every
rank yields the same number of batches in every stop mode (real worker processes; ranks as the
library sees them without a process group: RANK/WORLD_SIZE in the environment)."""
from __future__ import annotations

import numpy as np
import pytest

from pooled_loader import PooledLoader
from pooled_loader.mix import Mix
from test_mix import BASES, SIZES, WEIGHTS, Ids, flat, source_of


def _curriculum(step: int) -> dict:  # module level: it pickles
    return {"a": 0.0, "b": 1.0, "c": 0.0} if step % 2 else {"a": 1.0, "b": 0.0, "c": 0.0}


def _epochs(persistent: bool, change) -> list:
    mix = Mix({n: Ids(BASES[n], SIZES[n]) for n in SIZES}, dict(WEIGHTS), batch_size=8,
              stop="never", samples_per_epoch=160)
    loader = PooledLoader(mix, batch_size=8, num_workers=2, persistent_workers=persistent)
    out = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        if epoch == 2:
            change(mix)
        out.append([b.tolist() for b in loader])
    return out


@pytest.mark.parametrize("change", [
    lambda mix: mix.set_weights({"a": 0.05, "b": 0.05, "c": 0.9}),
    lambda mix: mix.set_weights(_curriculum),
], ids=["dict", "callable"])
def test_persistent_workers_see_set_weights_between_epochs(change):
    persistent = _epochs(True, change)
    assert persistent == _epochs(False, change)
    before = [source_of(x) for x in flat(persistent[1])]
    after = [source_of(x) for x in flat(persistent[2])]
    assert after.count("c") > 2 * before.count("c") or after.count("a") != before.count("a")
    assert persistent[3] != persistent[2]


def test_an_unpicklable_callable_set_later_is_refused_in_persistent_workers():
    with pytest.raises(Exception, match="does not pickle"):
        _epochs(True, lambda mix: mix.set_weights(lambda step: dict(WEIGHTS)))
