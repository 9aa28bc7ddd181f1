"""The NVML event watch's two ends, on the fake library that waits as the driver does: a hand-over (a rescan
that counts GPUs again, a reset) returns once NVML's init count is down, which takes the wait in progress;
a stop returns at once, and the watch's thread drops its reference when its wait returns."""

from __future__ import annotations

import textwrap

from test_fakenvml import GPUS, Rig, rig  # noqa: F401 (the fixture)

WATCH = """
import dataclasses
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
events = []
watch = NvmlEventWatch([Gpu(UUID, "gpu 0")], events.append, wait_ms=60000)
watch.start()
until("the watch waiting", lambda: header("event_waits") == "1")
"""


def watching(body: str) -> str:
    """`body` run once the watch of GPU 0 waits, 60 s a wait."""
    return f"UUID = {GPUS[0]['uuid']!r}\n" + WATCH + textwrap.dedent(body)


def test_a_stop_returns_at_once_and_the_watch_lets_nvml_go_when_its_wait_returns(rig: Rig) -> None:  # noqa: F811 (the fixture)
    out = rig.run(
        watching(
            """
            t = time.monotonic()
            watch.stop()
            out["stop_s"] = time.monotonic() - t
            out["stopped"] = [header("refcount"), header("event_waits")]  # the wait goes on, 60 s long
            CTL.xid(0, 79)
            watch.join(30)
            out["after"] = [header("refcount"), header("event_waits"), header("shutdown_waits"),
                            [type(e).__name__ for e in events]]
            """
        )
    )
    print(f"stop with a 60 s wait in progress: {out['stop_s'] * 1000:.2f} ms")
    assert out["stopped"] == ["1", "1"]
    # The XID that ended the wait was still told; then the reference went, with nothing waiting for it.
    assert out["after"] == ["0", "0", "0", ["HealthWatchChanged", "XidOccurred"]]


def test_a_hand_over_returns_once_nvml_s_count_is_down(rig: Rig) -> None:  # noqa: F811 (the fixture)
    out = rig.run(
        watching(
            """
            handing = threading.Thread(target=watch.hand_over)
            handing.start()
            time.sleep(0.3)
            out["handing"] = [handing.is_alive(), header("refcount")]
            CTL.xid(0, 48)
            handing.join(30)
            watch.join(30)
            out["after"] = [handing.is_alive(), header("refcount"), header("shutdown_waits"), header("sets")]
            """
        )
    )
    assert out["handing"] == [True, "1"]
    assert out["after"] == [False, "0", "1", "0"]
