"""The test helpers that choose what the default run covers."""

import itertools

from tests.helpers import alternating, pairwise


def test_pairwise_covers_every_pair_of_knob_values():
    grid = list(itertools.product([1, 2, 4], ["a", "b"], [0, 1, 2], [0.0, 0.5, 1.0]))
    chosen = pairwise(grid)
    assert len(chosen) == 9  # 3 × 3 pairs of the two largest knobs: no cover is smaller
    for i, j in itertools.combinations(range(4), 2):
        want = {(p[i], p[j]) for p in grid}
        assert {(p[i], p[j]) for p in chosen} == want, (i, j)


def test_alternating_takes_each_setting_once_and_the_last_knob_in_turn():
    grid = list(itertools.product(["x", "y", "z"], ["listed", "coin"]))
    assert alternating(grid) == [("x", "listed"), ("y", "coin"), ("z", "listed")]
