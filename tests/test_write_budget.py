"""The write budget as a value: a token bucket, on a clock the test turns."""

from __future__ import annotations

import pytest

from nvplug.base.write_budget import WriteBudget


def test_a_quiet_bucket_writes_at_once_then_paces_at_the_rate() -> None:
    bucket = WriteBudget(per_second=1.0, burst=2).bucket(now=0.0)
    # The burst: two at once.
    for _ in range(2):
        assert bucket.wait(0.0) == 0.0
        bucket.spend(0.0)
    # Then one a second.
    assert bucket.wait(0.0) == pytest.approx(1.0)
    assert bucket.wait(0.4) == pytest.approx(0.6)
    assert bucket.wait(1.0) == 0.0
    bucket.spend(1.0)
    assert bucket.wait(1.5) == pytest.approx(0.5)
    # Quiet for long: full again, never more than the burst.
    for _ in range(2):
        assert bucket.wait(100.0) == 0.0
        bucket.spend(100.0)
    assert bucket.wait(100.0) == pytest.approx(1.0)


def test_repairs_that_did_not_wait_leave_a_debt_of_at_most_a_burst() -> None:
    bucket = WriteBudget(per_second=2.0, burst=2).bucket(now=0.0)
    for _ in range(10):  # a storm of wipes, each repaired at once
        bucket.spend(0.0)
    # Two in debt at most, then a token: 3 tokens at 2 a second.
    assert bucket.wait(0.0) == pytest.approx(1.5)


@pytest.mark.parametrize("rate, burst", [(0.0, 2), (-1.0, 2), (1.0, 0)])
def test_a_budget_that_could_never_write_is_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="positive rate"):
        WriteBudget(rate, burst)
