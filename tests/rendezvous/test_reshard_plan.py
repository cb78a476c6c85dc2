"""The re-shard plan (``rendezvous.reshard.plan_rows``), run on plain lists: after both
phases every new rank holds exactly its new shard, and only rows it lacked moved."""

from __future__ import annotations

import itertools

import pytest

from pollux_launch.rendezvous.reshard import NEW, OLD, STAGED, plan_rows, shard_rows


def _simulate(n: int, old: tuple[str, ...], new: tuple[str, ...]) -> dict[str, list[int]]:
    """Run the plan on row labels: each worker's holdings as {kind: {row: label}}."""
    plan = plan_rows(n, old, new)
    have = {w: {OLD: {}, NEW: {}, STAGED: {}} for w in set(old) | set(new)}
    for i, w in enumerate(old):
        lo, hi = shard_rows(n, len(old), i)
        have[w][OLD] = {r: r for r in range(lo, hi)}
    for phase, members in ((plan.before, old), (plan.after, new)):
        for mv in phase:
            assert mv.src in members and mv.dst in members  # each phase on its own group
            for r in range(mv.start, mv.stop):
                have[mv.dst][mv.dst_kind][r] = have[mv.src][mv.src_kind][r]
    out = {}
    for j, w in enumerate(new):
        lo, hi = shard_rows(n, len(new), j)
        out[w] = [have[w][NEW].get(r) for r in range(lo, hi)]
    return out


CASES = [(2, 3), (3, 1), (1, 2), (2, 1), (4, 3), (3, 4), (1, 4), (4, 1), (5, 2), (2, 5)]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 64, 1000])
@pytest.mark.parametrize("before,after", CASES)
def test_every_new_shard_is_assembled_from_the_old_ones(n: int, before: int, after: int) -> None:
    old = tuple(f"w{i}" for i in range(before))
    for keep in range(1, min(before, after) + 1):  # keep survivors, some leave, some come
        for survivors in itertools.combinations(old, keep):
            if len(survivors) > after:
                continue
            new = list(survivors) + [f"n{i}" for i in range(after - len(survivors))]
            for order in {tuple(new), tuple(reversed(new))}:
                got = _simulate(n, old, order)
                for j, w in enumerate(order):
                    lo, hi = shard_rows(n, after, j)
                    assert got[w] == list(range(lo, hi)), (n, old, order, w)


def test_only_missing_rows_move_and_nothing_is_gathered() -> None:
    old, new = ("a", "b"), ("a", "b", "c")
    plan = plan_rows(12, old, new)
    moved = sum(mv.stop - mv.start for mv in plan.before + plan.after if mv.src != mv.dst)
    # a keeps 0-4 of its 0-6, b needs 4-8 (4-6 from a, 6-8 its own), c needs 8-12 from b
    assert moved == 2 + 4
    assert all(mv.stop - mv.start <= 6 for mv in plan.before + plan.after)


def test_a_leavers_rows_go_to_a_newcomer_through_a_survivor() -> None:
    plan = plan_rows(9, ("a", "b", "c"), ("a", "d", "e"))  # b and c leave, d and e come
    assert {mv.dst_kind for mv in plan.before if mv.dst != "a" or mv.src != "a"} >= {STAGED}
    assert all(mv.src == "a" for mv in plan.after)
    assert set(plan.staged) == {"a"}


def test_no_survivor_is_no_plan() -> None:
    with pytest.raises(ValueError, match="no worker"):
        plan_rows(4, ("a",), ("b",))
