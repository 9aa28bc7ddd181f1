"""The double-bit ECC ledger: an error the event watch missed is reported once from the driver's count, and
an event is reported unless the count shows that a catch-up reported its error already. The driver's count
is the one input here, scripted; the daemon-level tests are in tests/test_hang_events.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from nvplug.sources import ecc_counts
from nvplug.sources.ecc_counts import DoubleBitCounts

UUID = "GPU-00000000-0000-0000-0000-000000000004"
HANDLE = object()


class Driver:
    """The volatile count the driver would answer; None: unreadable."""

    def __init__(self, count: int | None = 0) -> None:
        self.count = count
        self.reads = 0
        self.hold = threading.Event()
        self.hold.set()

    def read(self, handle: Any) -> int | None:
        assert handle is HANDLE
        self.hold.wait()
        self.reads += 1
        return self.count


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Driver:
    d = Driver()
    monkeypatch.setattr(ecc_counts, "volatile_double_bit", d.read)
    return d


def test_a_first_sight_is_a_baseline_not_a_report(driver: Driver) -> None:
    driver.count = 3  # errors from before nvplug watched: the probes judge what they left
    counts = DoubleBitCounts()
    assert counts.catch_up(HANDLE, UUID) == 0
    driver.count = 4
    assert counts.confirm(HANDLE, UUID)


def test_errors_no_event_told_of_are_reported_once(driver: Driver) -> None:
    counts = DoubleBitCounts()
    counts.catch_up(HANDLE, UUID)
    driver.count = 2  # two errors while no event set existed
    assert counts.catch_up(HANDLE, UUID) == 2
    assert counts.catch_up(HANDLE, UUID) == 0


def test_an_event_whose_error_a_catch_up_reported_is_not_reported_again(driver: Driver) -> None:
    counts = DoubleBitCounts()
    counts.catch_up(HANDLE, UUID)
    driver.count = 1  # fired after the new watch subscribed, before the catch-up read: both saw it
    assert counts.catch_up(HANDLE, UUID) == 1
    assert not counts.confirm(HANDLE, UUID)
    # The next error is the event's to report.
    driver.count = 2
    assert counts.confirm(HANDLE, UUID)


def test_two_errors_two_events_one_catch_up_count_twice_in_all(driver: Driver) -> None:
    counts = DoubleBitCounts()
    counts.catch_up(HANDLE, UUID)
    driver.count = 1
    assert counts.catch_up(HANDLE, UUID) == 1  # the first error, its event still queued
    driver.count = 2  # a second error before that event is handled
    reported = [counts.confirm(HANDLE, UUID), counts.confirm(HANDLE, UUID)]
    assert reported == [True, False]


def test_an_event_with_no_rise_and_nothing_unclaimed_is_reported(driver: Driver) -> None:
    """A driver that counts the error after it posts the event must not lose it."""
    counts = DoubleBitCounts()
    counts.catch_up(HANDLE, UUID)
    assert counts.confirm(HANDLE, UUID)
    assert counts.confirm(HANDLE, UUID)


def test_an_unreadable_count_reports_every_event(driver: Driver) -> None:
    driver.count = None
    counts = DoubleBitCounts()
    assert counts.catch_up(HANDLE, UUID) == 0
    assert counts.confirm(HANDLE, UUID)
    assert counts.confirm(HANDLE, UUID)


def test_a_reset_starts_a_new_baseline(driver: Driver) -> None:
    counts = DoubleBitCounts()
    driver.count = 5
    counts.catch_up(HANDLE, UUID)
    driver.count = 0  # the GPU was reset: volatile counts start again
    assert counts.catch_up(HANDLE, UUID) == 0
    driver.count = 1
    assert counts.confirm(HANDLE, UUID)


def test_a_count_that_hangs_delays_the_event_by_the_bound_only(driver: Driver) -> None:
    counts = DoubleBitCounts(confirm_seconds=0.2)
    counts.catch_up(HANDLE, UUID)
    reads = driver.reads
    driver.hold.clear()  # the GPU's calls hang
    assert counts.confirm(HANDLE, UUID)
    assert driver.reads == reads, "reported while the count's read still hangs: it did not wait for it"
    driver.hold.set()
