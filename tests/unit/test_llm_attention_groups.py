"""How decoding sequences are grouped for attention: padded to the longest of their group,
split where padding would cost more than another group."""

from __future__ import annotations

import itertools

import pytest

from python_backends.llm.model import GROUP_SPLIT_SLOTS, group_by_length


def padded_slots(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(len(group) * max(lengths[i] for i in group) - sum(lengths[i] for i in group) for group in groups)


def test_close_lengths_share_one_group():
    lengths = [40, 44, 41, 52, 47]
    assert group_by_length(lengths) == [[0, 2, 1, 4, 3]]  # shortest first


def test_short_chats_and_long_essays_attend_apart():
    lengths = [60] * 18 + [400] * 6
    groups = group_by_length(lengths)
    assert [sorted(g) for g in groups] == [list(range(18)), list(range(18, 24))]
    assert padded_slots(lengths, groups) == 0  # one padded group would pad 18 x 340 slots


def test_every_sequence_is_in_exactly_one_group_and_padding_stays_bounded():
    lengths = [50, 420, 70, 300, 90, 120, 200, 420, 50, 300, 61, 199]
    groups = group_by_length(lengths, split_slots=256)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:  # each join padded the group by at most the split
        ordered = sorted(lengths[i] for i in group)
        assert all((b - a) * k <= 256 for k, (a, b) in enumerate(itertools.pairwise(ordered), start=1))
    assert padded_slots(lengths, groups) < padded_slots(lengths, [list(range(len(lengths)))])


def test_split_zero_pads_nothing_and_a_huge_split_makes_one_group():
    lengths = [10, 30, 20, 30]
    assert padded_slots(lengths, group_by_length(lengths, split_slots=0)) == 0
    assert len(group_by_length(lengths, split_slots=0)) == 3  # equal lengths still share
    assert len(group_by_length(lengths, split_slots=1 << 20)) == 1


def test_no_sequences_no_groups_and_a_negative_split_is_refused():
    assert group_by_length([]) == []
    assert GROUP_SPLIT_SLOTS > 0
    with pytest.raises(ValueError, match="split_slots"):
        group_by_length([1, 2], split_slots=-1)
