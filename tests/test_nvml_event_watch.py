"""The NVML event watch on the fake library that waits as the driver does: the wait runs in a child
process, so a hand-over (a rescan that counts GPUs again, a reset, a stop) returns at once, whatever the
wait's length, and a child that ends unasked is reported and replaced."""

from __future__ import annotations

import textwrap

from test_fakenvml import GPUS, Rig, rig  # noqa: F401 (the fixture)

WATCH = """
import dataclasses, os, signal
from nvplug.sources.nvml_events import NvmlEventWatch
@dataclasses.dataclass(frozen=True)
class Gpu:
    uuid: str
    label: str
def until(what, check):
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
def names():
    return [type(e).__name__ for e in events]
events = []
watch = NvmlEventWatch([Gpu(UUID, "gpu 0")], events.append, wait_ms=60000)
watch.start()
pid = watch._pump.pid
"""


def watching(body: str) -> str:
    """`body` run once GPU 0 is subscribed, its child waiting 60 s a wait."""
    return f"UUID, UUID1 = {GPUS[0]['uuid']!r}, {GPUS[1]['uuid']!r}\n" + WATCH + textwrap.dedent(body)


def test_an_xid_reaches_the_watch_through_its_child_and_a_hand_over_ends_both_at_once(rig: Rig) -> None:  # noqa: F811 (the fixture)
    out = rig.run(
        watching(
            """
            out["subscribed"] = [watch.subscribed, header("refcount"), header("sets")]
            CTL.xid(0, 79)
            until("the XID", lambda: "XidOccurred" in names())
            t = time.monotonic()
            watch.hand_over()
            out["hand_over_s"] = time.monotonic() - t
            watch.join(30)
            out["after"] = [alive(pid), header("refcount"), header("shutdown_waits"), watch.subscribed, names()]
            """
        )
    )
    print(f"hand-over with a 60 s wait in progress: {out['hand_over_s'] * 1000:.2f} ms")
    # Our process holds the one reference for the event's reads; the event set is the child's. The hand-over
    # returned with the child's 60-s wait in progress (the run's own limit is 60 s): the child is gone, and
    # our reference with it.
    assert out["subscribed"] == [True, "1", "0"]
    assert out["after"] == [False, "0", "0", False, ["HealthWatchChanged", "XidOccurred"]]


def test_a_child_that_ends_unasked_is_reported_and_another_takes_its_place(rig: Rig) -> None:  # noqa: F811 (the fixture)
    out = rig.run(
        watching(
            """
            os.kill(pid, signal.SIGKILL)
            until("another child", lambda: watch.subscribed and watch._pump is not None and watch._pump.pid != pid)
            CTL.xid(0, 48)
            until("the XID", lambda: "XidOccurred" in names())
            out["events"] = [str(e) for e in events]
            out["add"] = [watch.add([Gpu(UUID1, "gpu 1")]), sorted(watch.subscriptions)]
            watch.hand_over()
            """
        )
    )
    # The new child takes more GPUs: what the ended one left behind is no answer of its.
    assert out["add"] == [True, sorted([GPUS[0]["uuid"], GPUS[1]["uuid"]])]
    events = out["events"]
    assert events[0] == "HealthWatchChanged(error=None)"
    assert "killed by signal 9; starting another" in events[1], events
    assert events[2:] == [
        "HealthWatchChanged(error=None)",
        f"XidOccurred(uuid='{GPUS[0]['uuid']}', code=48, gpu_instance=None, compute_instance=None)",
    ]


def test_an_event_in_a_hand_overs_overlap_is_reported_once_and_none_is_lost(rig: Rig) -> None:  # noqa: F811 (the fixture)
    out = rig.run(
        watching(
            """
            from nvplug.sources.watch_overlap import WatchOverlap
            watch.hand_over()  # the prelude's own watch: not one of the two here
            watch.join(30)
            events.clear()
            def xids():
                return [e.code for e in events if type(e).__name__ == "XidOccurred"]
            overlap = WatchOverlap()
            old = NvmlEventWatch([Gpu(UUID, "gpu 0")], events.append, wait_ms=60000, overlap=overlap)
            old.start()
            CTL.xid(0, 48)
            until("48", lambda: xids() == [48])
            old.let_go()  # a rescan that counts the GPUs again: the old child listens on
            CTL.xid(0, 43)  # before the new watch subscribed: told by the old alone
            until("43", lambda: xids() == [48, 43])
            new = NvmlEventWatch([Gpu(UUID, "gpu 0")], events.append, wait_ms=60000, overlap=overlap)
            new.start()
            for code in (13, 13, 31):  # both children hear each
                CTL.xid(0, code)
            until("the second telling of each", lambda: overlap.dropped == 3)
            old.hand_over()
            old.join(30)
            CTL.xid(0, 13)  # after the hand-over: told by the new watch alone, and a new event
            until("the last 13", lambda: xids().count(13) == 3)
            new.hand_over()
            new.join(30)
            out["xids"] = xids()
            out["dropped"] = overlap.dropped
            """
        )
    )
    assert out["xids"] == [48, 43, 13, 13, 31, 13], out
    assert out["dropped"] == 3


def test_the_child_speaks_to_a_daemon_from_before_the_stamps_as_that_daemon_reads(rig: Rig) -> None:  # noqa: F811 (the fixture)
    """A package upgrade replaces the child's program before it restarts the daemon: an old daemon that starts
    a child meanwhile (a hot-add) reads its lines as they were. Stamps only where asked."""
    out = rig.run(
        watching(
            """
            import subprocess, sys
            from nvplug.sources.nvml_events import PUMP_PROGRAM, WANTED
            def lines(stamp, code):
                child = subprocess.Popen(
                    [sys.executable, "-S", "-P", str(PUMP_PROGRAM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True,
                )
                child.stdin.write(("stamp\\n" if stamp else "") + f"subscribe {WANTED:x} 60000 {UUID}\\n")
                child.stdin.flush()
                said = [child.stdout.readline().split(), child.stdout.readline().split()]
                CTL.xid(0, code)
                said.append(child.stdout.readline().split())
                child.kill()
                child.wait()
                return said
            out["old"] = lines(False, 43)
            out["new"] = lines(True, 48)
            watch.hand_over()
            """
        )
    )
    uuid = GPUS[0]["uuid"]
    (subscribed, done, event) = out["old"]
    assert subscribed[:2] == ["subscribed", uuid] and len(subscribed) == 3, subscribed
    assert done == ["done"] and event == ["event", uuid, "8", "43", "4294967295", "4294967295"], event
    (subscribed, done, event) = out["new"]
    assert subscribed[:2] == ["subscribed", uuid] and len(subscribed) == 4 and int(subscribed[3]) > 0, subscribed
    assert done == ["done"] and event[:6] == ["event", uuid, "8", "48", "4294967295", "4294967295"], event
    assert len(event) == 7 and int(event[6]) >= int(subscribed[3]), (subscribed, event)


def test_a_child_from_before_the_stamps_is_still_read(rig: Rig) -> None:  # noqa: F811 (the fixture)
    """The other way round (a downgrade, until the daemon restarts): a child's program that knows no `stamp`
    answers in the lines without them, and its GPUs and events are taken as they were."""
    out = rig.run(
        watching(
            """
            from nvplug.sources import nvml_events
            from nvplug.sources.watch_overlap import WatchOverlap
            watch.hand_over()
            watch.join(30)
            events.clear()
            older = Path(sys.argv[1]).parent / "nvml_event_pump.py"  # the rig's own directory
            text = nvml_events.PUMP_PROGRAM.read_text()
            assert 'words == ["stamp"]' in text
            older.write_text(text.replace('words == ["stamp"]', 'words == ["not known then"]'))
            nvml_events.PUMP_PROGRAM = older
            old = NvmlEventWatch([Gpu(UUID, "gpu 0")], events.append, wait_ms=60000, overlap=WatchOverlap())
            old.start()
            CTL.xid(0, 13)
            until("13", lambda: "XidOccurred" in names())
            out["subscriptions"] = sorted(old.subscriptions)
            out["stamps"] = old.subscribed_at
            out["events"] = [str(e) for e in events]
            old.hand_over()
            """
        )
    )
    assert out["subscriptions"] == [GPUS[0]["uuid"]] and out["stamps"] == {}
    assert out["events"] == [
        "HealthWatchChanged(error=None)",
        f"XidOccurred(uuid='{GPUS[0]['uuid']}', code=13, gpu_instance=None, compute_instance=None)",
    ]
