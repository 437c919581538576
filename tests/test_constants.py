"""The shared policy numbers and helpers in pooled_loader.core.constants."""
import pytest

from pooled_loader import PooledLoader
from pooled_loader.core.constants import ALIGN, default_pool_slots, round_up
from pooled_loader.tune.trials import Setting


@pytest.mark.parametrize("n, to, expected", [(0, 64, 0), (1, 64, 64), (64, 64, 64), (65, 64, 128),
                                             (4097, 4096, 8192)])
def test_round_up_gives_the_next_multiple(n, to, expected):
    assert round_up(n, to) == expected


def test_round_up_defaults_to_the_leaf_alignment():
    assert ALIGN == 64 and round_up(1) == ALIGN


def test_default_pool_is_the_batches_in_flight_plus_two_slots():
    assert default_pool_slots(0, None) == 3  # in-process: one batch in flight
    assert default_pool_slots(4, None) == 4 * 2 + 2  # prefetch_factor defaults to 2
    assert default_pool_slots(4, 3) == 4 * 3 + 2
    assert default_pool_slots(4, 3, extra=5) == 4 * 3 + 5


def test_loader_and_tuner_size_the_pool_alike():
    data = list(range(8))
    for workers, prefetch in [(0, None), (2, None), (1, 4)]:
        loader = PooledLoader(data, batch_size=2, num_workers=workers, prefetch_factor=prefetch)
        expected = Setting(workers, 2, prefetch or 2, 2).pool_slots
        assert loader._default_slots() == expected
        loader.close()
