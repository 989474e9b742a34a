"""``--max NAME=LO..HI``: the largest value that fits, by bisection.

Memory grows with the searched value (a batch size, a sequence length), so "fits" is true up to
some value and false after it; bisection finds that value with about log2(HI-LO) predictions and
checks both sides of it: the answer was predicted to fit and the next value was predicted not to.
"""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest ``v`` in ``[low, high]`` with ``fits(v)``, assuming ``fits`` is true up to some
    point and false after it; None when ``low`` does not fit. ``fits`` is called at most once per
    value, and on ``v + 1`` of the answer whenever that is within the range."""
    if not fits(low):
        return None
    if low == high or fits(high):
        return high
    good, bad = low, high  # fits(good), not fits(bad)
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
