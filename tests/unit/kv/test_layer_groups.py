"""The read queue's layer groups: in order, no gaps, small first."""

import pytest
from dualpath.kv.queue import layer_groups


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 8, 9, 32, 61])
@pytest.mark.parametrize("max_group", [1, 2, 4, 8])
def test_groups_cover_every_layer_once_in_order(layers, max_group):
    groups = layer_groups(layers, max_group)
    assert [i for l0, l1 in groups for i in range(l0, l1)] == list(range(layers))
    assert all(1 <= l1 - l0 <= max_group for l0, l1 in groups)
    assert groups[0] == (0, 1)  # the pipeline's fill stays one layer's read


def test_groups_grow_to_the_cap():
    assert layer_groups(32, 4) == [(0, 1), (1, 2), (2, 4)] + [(i, i + 4) for i in range(4, 32, 4)]
    assert layer_groups(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
