"""`spread_onto`: how many running requests move onto a worker that joined the pool."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.placement import spread_onto


def test_a_worker_moved_in_beside_a_busy_one_takes_half_its_requests() -> None:
    assert spread_onto({"decode-0": 17, "decode-1": 0}, "decode-1") == {"decode-0": 8}
    assert spread_onto({"decode-0": 16, "decode-1": 0}, "decode-1") == {"decode-0": 8}


def test_the_busiest_give_first_and_nobody_gives_below_the_new_count() -> None:
    # a gives until it is level with b; then the new worker holds 4 and a, b 5: one apart.
    assert spread_onto({"a": 9, "b": 5, "c": 2, "new": 0}, "new") == {"a": 4}
    assert spread_onto({"a": 6, "b": 6, "new": 0}, "new") == {"a": 2, "b": 2}
    assert spread_onto({"a": 7, "b": 6, "new": 0}, "new") == {"a": 3, "b": 1}


def test_an_even_pool_moves_nothing() -> None:
    assert spread_onto({"a": 3, "new": 2}, "new") == {}
    assert spread_onto({"a": 0, "new": 0}, "new") == {}
    assert spread_onto({"new": 5}, "new") == {}


@given(st.lists(st.integers(0, 60), min_size=1, max_size=6), st.integers(0, 60))
def test_after_the_moves_nobody_holds_two_more_than_the_new_worker(
        others: list[int], joined: int) -> None:
    counts = {f"w{i}": n for i, n in enumerate(others)} | {"new": joined}
    moves = spread_onto(counts, "new")
    after = {w: n - moves.get(w, 0) for w, n in counts.items()}
    after["new"] = joined + sum(moves.values())
    assert all(0 < n <= counts[w] for w, n in moves.items())
    assert max(n for w, n in after.items() if w != "new") - after["new"] <= 1
    # Nobody gave more than it had above the final count of the new worker.
    assert all(after[w] >= after["new"] - 1 for w in moves)
