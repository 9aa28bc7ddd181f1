"""The hand-over ledger alone, with stamps of the test's own: which tellings of an event two NVML event
watches share, and which are new. The same on real child processes: `test_nvml_event_watch.py`."""

from __future__ import annotations

from nvplug.sources.watch_overlap import Told, WatchOverlap

XID = 0x8
UUID = "GPU-0e85ec6b-0000-0000-0000-000000000000"
SINCE, UNTIL = 1_000, 2_000  # ns: the new child registered GPU 0's events, the old child was killed
OTHER = "GPU-a7872170-0000-0000-0000-000000000000"


def xid(code: int, uuid: str = UUID) -> Told:
    return (uuid, XID, code, 0xFFFFFFFF, 0xFFFFFFFF)


def overlapping() -> tuple[WatchOverlap, object, object]:
    overlap = WatchOverlap()
    old, new = object(), object()
    overlap.retire(old)
    overlap.subscribed(new, {UUID: SINCE, OTHER: SINCE + 500})
    return overlap, old, new


def test_an_event_both_watches_tell_is_reported_once_whichever_tells_it_first() -> None:
    overlap, old, new = overlapping()
    assert [overlap.first_telling(old, xid(79), 1_100), overlap.first_telling(new, xid(79), 1_101)] == [True, False]
    assert [overlap.first_telling(new, xid(48), 1_200), overlap.first_telling(old, xid(48), 1_200)] == [True, False]
    assert overlap.dropped == 2


def test_an_event_that_fires_again_is_reported_again() -> None:
    overlap, old, new = overlapping()
    # A burst of three, each told by both, in whatever order the two readers get to them.
    told = [(old, 1_100), (old, 1_200), (new, 1_100), (old, 1_300), (new, 1_200), (new, 1_300)]
    assert [overlap.first_telling(w, xid(13), at) for w, at in told] == [True, True, False, True, False, False]
    # Another GPU's, or another code's, is its own.
    assert overlap.first_telling(new, xid(13, OTHER), 1_600)
    assert overlap.first_telling(new, xid(31), 1_400)
    assert overlap.dropped == 3


def test_what_one_watch_alone_heard_is_never_taken_for_the_others_copy() -> None:
    overlap, old, new = overlapping()
    # The old child alone heard these (before the new one subscribed), though its reader gets to them late.
    assert overlap.first_telling(old, xid(13), SINCE - 1)
    assert overlap.first_telling(old, xid(13), SINCE - 1)
    overlap.ended(old, UNTIL)
    # The new child alone heard this one (after the old one's kill), and its reader lags too.
    assert overlap.first_telling(new, xid(13), UNTIL + 1)
    # One both heard, the old watch's copy read first: the new watch's is the one dropped.
    assert overlap.first_telling(old, xid(31), UNTIL - 1)
    assert not overlap.first_telling(new, xid(31), UNTIL - 1)
    # Another GPU's, after GPU 0's registration but before its own: the old child alone heard it; and the
    # same event of it again, after its registration.
    assert overlap.first_telling(old, xid(31, OTHER), SINCE + 100)
    assert overlap.first_telling(new, xid(31, OTHER), SINCE + 600)
    assert overlap.dropped == 1


def test_no_overlap_where_the_old_watch_ended_first_or_none_was_retired() -> None:
    overlap = WatchOverlap()
    old, new, newer = object(), object(), object()
    # Before the new watch subscribes, the old watch's events are its own.
    overlap.retire(old)
    assert overlap.first_telling(old, xid(13), SINCE - 5)
    overlap.ended(old)  # its child ended before the next watch subscribed: it tells nothing more
    overlap.subscribed(new, {UUID: SINCE, OTHER: SINCE + 500})
    assert overlap.first_telling(new, xid(13), SINCE + 1)
    assert overlap.first_telling(new, xid(13), SINCE + 2)
    overlap.subscribed(newer, {UUID: SINCE})  # a watch started again after a child's end: none was retired
    assert overlap.first_telling(newer, xid(13), SINCE + 3)
    assert overlap.dropped == 0
