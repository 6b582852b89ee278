"""Live streams go to the least-loaded GPU group: fewest streams, then the shortest measured VLM
queue, then the lowest index; ended streams stop counting."""
from __future__ import annotations

import threading

import pytest

from pipeline.serve.placement import Placement


def test_new_streams_fill_the_groups_evenly_lowest_index_first():
    placement = Placement(3)
    assert [placement.place(f"s{i}") for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert placement.counts() == [3, 2, 2]


def test_a_tie_goes_to_the_group_with_the_shorter_measured_queue():
    placement = Placement(3)
    assert placement.place("a", pending=[5, 0, 2]) == 1
    assert placement.place("b", pending=[5, 9, 2]) == 2          # 0 and 2 have no stream: 2's queue is shorter
    assert placement.place("c", pending=[5, 9, 2]) == 0          # streams first: only 0 has none
    assert placement.place("d", pending=[0, 9, 1]) == 0          # all have one: the shortest queue


def test_ended_streams_free_their_group():
    placement = Placement(2)
    for sid in ("a", "b", "c", "d"):
        placement.place(sid)
    placement.release("a")
    placement.release("c")                                      # both of group 0
    assert placement.counts() == [0, 2]
    assert placement.place("e") == 0 and placement.place("f") == 0 and placement.place("g") == 0
    assert placement.counts() == [3, 2]
    placement.release("never-placed")                           # ignored
    placement.release("a")                                      # twice: ignored
    assert placement.counts() == [3, 2] and placement.group_of("a") is None and placement.group_of("e") == 0


def test_a_placed_stream_keeps_its_group():
    placement = Placement(2)
    assert placement.place("a") == 0
    assert placement.place("a", pending=[9, 0]) == 0 and placement.counts() == [1, 0]


def test_concurrent_starts_spread_evenly():
    placement = Placement(4)
    threads = [threading.Thread(target=placement.place, args=(f"s{i}",)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert placement.counts() == [16, 16, 16, 16]


@pytest.mark.parametrize("groups, pending, message", [
    (0, None, "at least one group, got 0"),
    (2, [1], "pending has 1 entries for 2 groups"),
])
def test_bad_input(groups, pending, message):
    with pytest.raises(ValueError, match=message):
        Placement(groups).place("a", pending=pending)
