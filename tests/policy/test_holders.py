"""keep_holders: a target allocation leaves every running live job a replica on a node
whose worker holds its training state (pollux_launch/policy/holders.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pollux_launch.policy.holders import keep_holders, stranded_jobs


def a(rows):
    return np.array(rows, dtype=np.int64)


def test_a_shrink_keeps_the_holder_not_the_empty_newcomer():
    """The issue's case: job 1 ran on [n1, n2], only n1's worker holds state (n2's is a
    fresh replacement); a new job 0 takes one slot and the policy kept job 1 on n2. The
    newcomer's replica on n1 is new there: the two swap."""
    out = keep_holders(a([[1, 0], [0, 1]]), a([[0, 0], [1, 1]]), a([[0, 0], [1, 0]]),
                       a([1, 1]))
    assert out.target.tolist() == [[0, 1], [1, 0]]
    assert out.moved.tolist() == [False, True] and not out.stranded.any()


def test_a_free_slot_on_the_holder_node_is_used_before_a_swap():
    out = keep_holders(a([[1, 0, 0], [0, 1, 0]]), a([[0, 0, 0], [1, 1, 0]]),
                       a([[0, 0, 0], [1, 0, 0]]), a([2, 1, 1]))
    assert out.target.tolist() == [[1, 0, 0], [1, 0, 0]]


def test_holders_kept_by_the_target_change_nothing():
    target = a([[1, 0], [0, 1]])
    for holders in (a([[0, 0], [0, 1]]), a([[0, 0], [1, 1]]), a([[0, 0], [0, 0]])):
        out = keep_holders(target, a([[0, 0], [1, 1]]), holders, a([1, 1]))
        assert np.array_equal(out.target, target) and not out.moved.any()


def test_a_job_stopped_by_the_policy_is_left_stopped():
    """Zero replicas is the policy's decision (preempted, cancelled): nothing to keep."""
    out = keep_holders(a([[2, 0]]), a([[1, 1]]), a([[0, 1]]), a([2, 1]))
    assert stranded_jobs(a([[0, 0]]), a([[0, 1]])).tolist() == [False]
    out = keep_holders(a([[0, 0]]), a([[1, 1]]), a([[0, 1]]), a([2, 1]))
    assert out.target.tolist() == [[0, 0]] and not out.stranded.any()


def test_a_replica_that_was_already_running_is_never_swapped_away():
    """The holder node is full of another job's replicas that ran there before: no move;
    the job stays stranded (the caller says so) and nothing exceeds a node's slots."""
    target, current = a([[1, 0], [0, 1]]), a([[1, 0], [1, 1]])
    out = keep_holders(target, current, a([[0, 0], [1, 0]]), a([1, 1]))
    assert np.array_equal(out.target, target) and out.stranded.tolist() == [False, True]


def test_another_jobs_holders_are_never_displaced():
    """Job 0's replica on n1 is new in its row but covers a worker of job 0 holding state
    there (its allocation had moved away, the worker lives on): not swappable."""
    target, current = a([[1, 0], [0, 1]]), a([[0, 1], [1, 0]])
    holders = a([[1, 0], [1, 0]])
    out = keep_holders(target, current, holders, a([1, 1]))
    assert np.array_equal(out.target, target) and out.stranded.tolist() == [False, True]


def test_a_job_that_may_not_change_is_neither_repaired_nor_swapped():
    target, current, holders = a([[1, 0], [0, 1]]), a([[0, 0], [1, 1]]), a([[0, 0], [1, 0]])
    out = keep_holders(target, current, holders, a([1, 1]), movable=np.array([False, True]))
    assert np.array_equal(out.target, target) and out.stranded.tolist() == [False, True]
    out = keep_holders(target, current, holders, a([1, 1]), movable=np.array([True, False]))
    assert np.array_equal(out.target, target)


def test_no_slots_on_the_holder_node_means_no_repair():
    """A draining node (offered with 0 slots) cannot keep the holder."""
    out = keep_holders(a([[0, 1]]), a([[1, 0]]), a([[1, 0]]), a([0, 1]))
    assert out.target.tolist() == [[0, 1]] and out.stranded.tolist() == [True]


def test_the_move_prefers_not_to_spread_jobs():
    """Job 1 (2 replicas, both on n2 in the target) holds state on n1 and n3, where the
    new job 0 landed (one replica on n1, two on n3; every node full). Swapping job 1's
    two replicas with job 0's two on n3 keeps each job on as many nodes as before;
    swapping one with n1 would spread job 1 over two nodes and job 0 over three."""
    target = a([[1, 0, 2], [0, 2, 0]])
    current = a([[0, 0, 0], [1, 0, 1]])
    holders = a([[0, 0, 0], [1, 0, 1]])
    out = keep_holders(target, current, holders, a([1, 2, 2]))
    assert out.target.tolist() == [[1, 2, 0], [0, 0, 2]]


def test_a_job_moved_whole_is_moved_back_whole():
    """pollux-dp re-packs a job whose count changed anywhere: job 1 (4 replicas on n1,
    all holding state) grows to 6 and lands on n2, the newcomer job 0 on n1's 4 slots.
    The swap moves blocks, not one replica: job 0 goes whole to n2, and 4 of job 1's 6
    go back to n1 (as many as job 0 had there)."""
    target = a([[4, 0], [0, 6]])
    current = a([[0, 0], [4, 0]])
    holders = a([[0, 0], [4, 0]])
    out = keep_holders(target, current, holders, a([4, 8]))
    assert out.target.tolist() == [[0, 4], [4, 2]]
    # with room on n1 no other job moves
    out = keep_holders(a([[0, 0], [0, 3]]), current, holders, a([4, 8]))
    assert out.target.tolist() == [[0, 0], [3, 0]]


def test_several_stranded_jobs_share_the_room():
    """Two stranded jobs, each with a holder on its own full node where a newcomer job
    landed: both swap with it."""
    target = a([[1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    current = a([[0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]])
    holders = a([[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]])
    out = keep_holders(target, current, holders, a([1, 1, 1, 1]))
    assert out.target.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0]]
    assert out.moved.tolist() == [False, True, True]


def test_bad_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match="must be"):
        keep_holders(a([[1, 0]]), a([[1, 0]]), a([[1, 0]]), a([1, 1, 1]))
    with pytest.raises(ValueError, match="movable"):
        keep_holders(a([[1, 0]]), a([[1, 0]]), a([[1, 0]]), a([1, 1]), np.ones(2, bool))


# -- properties ---------------------------------------------------------------------------

@st.composite
def rounds(draw, max_jobs: int = 5, max_nodes: int = 4):
    """A feasible target and current allocation on small nodes, and holders on the
    current nodes or beyond (a worker the allocation had moved away from)."""
    J = draw(st.integers(1, max_jobs))
    N = draw(st.integers(1, max_nodes))
    slots = np.array(draw(st.lists(st.integers(0, 3), min_size=N, max_size=N)), np.int64)

    def matrix():
        m = np.zeros((J, N), np.int64)
        for n in range(N):  # fill each column up to its slots
            for _ in range(draw(st.integers(0, int(slots[n])))):
                m[draw(st.integers(0, J - 1)), n] += 1
        return m

    target, current = matrix(), matrix()
    # 0-2: that many of its current replicas there hold state; 3: one worker holds state
    # on a node its allocation no longer names (it lives on)
    mask = np.array(draw(st.lists(st.integers(0, 3), min_size=J * N, max_size=J * N)),
                    np.int64).reshape(J, N)
    holders = np.where(mask == 3, 1, np.minimum(current, mask))
    movable = np.array(draw(st.lists(st.booleans(), min_size=J, max_size=J)))
    movable |= draw(st.booleans())  # often every job
    return target, current, holders, slots, movable


def _coverage(m, holders):
    return np.minimum(m, holders)


def _has_move(out, current, holders, slots, movable, j) -> bool:
    """Whether stranded job ``j`` has a move of the rule left in ``out``."""
    H = np.flatnonzero(holders[j] > 0)
    if np.any(out[:, H].sum(axis=0) < slots[H]):
        return True
    excess = out[:, H] > np.maximum(current[:, H], holders[:, H])
    excess[j] = False
    excess[~movable] = False
    return bool(excess.any())


@settings(max_examples=400, deadline=None)
@given(rounds())
def test_properties(case):
    target, current, holders, slots, movable = case
    out = keep_holders(target, current, holders, slots, movable)
    t = out.target
    assert (t >= 0).all()
    assert np.array_equal(t.sum(axis=1), target.sum(axis=1))  # replica counts unchanged
    assert (t.sum(axis=0) <= np.maximum(target.sum(axis=0), slots)).all()  # capacity
    assert np.array_equal(t[~movable], target[~movable])
    before = stranded_jobs(target, holders)
    # no job's covered holders shrink (a stranded one had none covered)
    assert (_coverage(t, holders)[~before] >= _coverage(target, holders)[~before]).all()
    assert np.array_equal(out.stranded, stranded_jobs(t, holders))
    assert not (out.stranded & ~before).any() and not (out.moved & out.stranded).any()
    assert np.array_equal(out.moved, before & ~out.stranded)
    # holders kept whenever a repair exists: no stranded movable job has a move left
    for j in np.flatnonzero(out.stranded & movable):
        assert not _has_move(t, current, holders, slots, movable, j), (j, t)
    # a job alone in its trouble is repaired exactly when a move exists for it
    if before.sum() == 1:
        (j,) = np.flatnonzero(before)
        assert out.moved[j] == (movable[j] and _has_move(target, current, holders, slots,
                                                          movable, j))
    again = keep_holders(t, current, holders, slots, movable)
    assert np.array_equal(again.target, t)  # a fixed point
