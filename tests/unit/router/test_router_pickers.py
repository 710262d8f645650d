"""Table tests of the pickers: tie-breaking, seeding and weighting."""

from __future__ import annotations

from collections import Counter

import pytest
from splitserve.components.router.plugins import max_score, weighted_random

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("scored", "expected"), [
    ({1: 0.2, 2: 0.9, 3: 0.5}, 2),
    ({5: 1.0, 2: 1.0, 9: 0.1}, 2),
    ({7: 0.0}, 7),
])
def test_max_score_lowest_id(scored, expected):
    picker = max_score.MaxScorePicker(max_score.Params(tie_break="lowest-id"))
    assert picker.pick(scored) == expected


def test_max_score_random_ties_stay_among_the_best_and_are_seeded():
    scored = {1: 0.5, 2: 0.9, 3: 0.9, 4: 0.9}
    picks = [max_score.MaxScorePicker(max_score.Params(seed=7)) for _ in range(2)]
    runs = [[p.pick(scored) for _ in range(50)] for p in picks]
    assert runs[0] == runs[1]
    assert set(runs[0]) == {2, 3, 4}
    reordered = dict(reversed(list(scored.items())))
    again = max_score.MaxScorePicker(max_score.Params(seed=7))
    assert [again.pick(reordered) for _ in range(50)] == runs[0]


def test_weighted_random_is_seeded_and_follows_weights():
    scored = {1: 3.0, 2: 1.0, 3: 0.0}
    first = weighted_random.WeightedRandomPicker(weighted_random.Params(seed=3))
    second = weighted_random.WeightedRandomPicker(weighted_random.Params(seed=3))
    picks = [first.pick(scored) for _ in range(400)]
    assert picks == [second.pick(scored) for _ in range(400)]
    counts = Counter(picks)
    assert counts[3] == 0
    assert 2.0 < counts[1] / counts[2] < 4.5


def test_weighted_random_all_zero_is_uniform_over_candidates():
    picker = weighted_random.WeightedRandomPicker(weighted_random.Params(seed=1))
    picks = Counter(picker.pick({4: 0.0, 5: 0.0}) for _ in range(200))
    assert set(picks) == {4, 5}
