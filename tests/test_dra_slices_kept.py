"""DRA slices checked, not assumed: the kubelet's late start-up wipe, a slice deleted by hand, and the
watch that brings them back, across its own end and an expired resourceVersion; what /status,
/metrics, the status line and doctor say while the API server does not hold them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from support.apiserver_standin import FakeApiServer
from support.dra_kubelet_standin import DraKubelet
from test_doctor import doctor
from test_dra_e2e import DRIVER, NODE, Dra, serving

from nvplug.status import status_client as statusclient
from nvplug.testing.simulated_node import SimulatedNode

TIMEOUT = 15.0
# The kubelet 1.32's wipe landed up to 60 ms after its registration of the plugin, after nvplug had
# written its slices. Here later still, so that it surely comes after that write; well before the
# settle time's list (2 s), so that what brings them back within a second is the watch.
LATE = 0.3


@pytest.fixture
def late(node: SimulatedNode) -> Iterator[Dra]:
    api = FakeApiServer(versions=("v1",), netns=node.netns)
    api.bookmark_seconds = 0.2
    api.start()
    yield from serving(node, api, DraKubelet(node.root / "registry", NODE, "1.32", api, late_wipe=LATE))


def status(dra: Dra) -> dict[str, object]:
    doc = statusclient.status(f"unix:{dra.node.status_socket}", timeout=5)
    found: dict[str, object] = doc["dra"]
    return found


def back_after(dra: Dra, since: float) -> float:
    """Seconds from `since` to the API server holding the whole pool again."""
    dra.wait(lambda: len(dra.pool()) == 4, "the slices written again")
    return time.monotonic() - since


def test_a_wipe_after_the_registration_is_written_back_within_a_second(late: Dra) -> None:
    late.start()
    late.wait(lambda: bool(late.kubelet.wipes), "the kubelet's late wipe")
    wiped_at, deleted = late.kubelet.wipes[0]
    registered = late.kubelet.registrations[0]
    assert registered.ok
    took = back_after(late, wiped_at)
    print(f"late wipe ({deleted} slices, {LATE * 1000:.0f} ms after the registration): back in {took * 1000:.1f} ms")
    assert deleted >= 1 and took < 1.0
    late.node.wait_log("was deleted by someone else; writing the pool again", TIMEOUT)
    late.wait(lambda: bool(status(late)["published"]), "/status to say the API server holds the pool")
    # The kubelet restarts again: the same, every time.
    for _ in range(3):
        before = len(late.kubelet.wipes)
        late.kubelet.restart()
        late.wait(lambda count=before: len(late.kubelet.wipes) > count, "the next late wipe")
        since, deleted = late.kubelet.wipes[-1]
        assert deleted >= 1 and back_after(late, since) < 1.0


def test_a_slice_deleted_by_hand_comes_back_and_status_says_the_truth_meanwhile(late: Dra) -> None:
    late.start()
    late.wait(lambda: bool(late.kubelet.wipes) and len(late.pool()) == 4, "the pool after the wipe")
    late.wait(lambda: late.api.watchers == 1, "the watch")
    # Deleted while the API server refuses nvplug's writes: the slices stay gone, and everything says so.
    late.api.fail_next(1000, 503, "ServiceUnavailable", writes_only=True)
    late.api.delete_slices(NODE)
    late.wait(lambda: not status(late)["published"], "/status to say the slices are not held")
    _, metrics = statusclient.fetch(f"unix:{late.node.status_socket}", "/metrics", timeout=5)
    assert f'nvplug_dra_slices_published{{driver="{DRIVER}"}} 0.0' in metrics
    found = status(late)
    change = found["foreign_change"]
    assert isinstance(change, dict) and str(change["what"]).startswith("deleted ")
    d = doctor(late.node, f"unix:{late.node.status_socket}")
    late.api.fail_next(0)
    assert d.verdict(12) == "FAIL", d
    assert "by someone else at" in d.out and "the kubelet deletes its node's slices when it starts" in d.out
    since = time.monotonic()
    took = back_after(late, since)
    late.wait(lambda: bool(status(late)["published"]), "/status to say the pool is held again")
    _, metrics = statusclient.fetch(f"unix:{late.node.status_socket}", "/metrics", timeout=5)
    assert f'nvplug_dra_slices_published{{driver="{DRIVER}"}} 1.0' in metrics
    print(f"a slice deleted by hand, the API server refusing writes: back {took * 1000:.1f} ms after it took them")
    # And with the API server answering: back at once.
    since = time.monotonic()
    late.api.delete_slices(NODE)
    assert back_after(late, since) < 1.0


def test_the_watch_outlives_its_end_and_an_expired_version(late: Dra) -> None:
    late.start()
    late.wait(lambda: bool(late.kubelet.wipes) and len(late.pool()) == 4, "the pool after the wipe")
    late.wait(lambda: late.api.watchers == 1, "the watch")
    watches = sum(1 for m, t, _ in late.api.requests if m == "GET" and "watch=true" in t)
    late.api.compact()
    late.api.end_watches()
    late.wait(lambda: late.api.watchers == 1, "the watch made again")
    since = time.monotonic()
    late.api.delete_slices(NODE)
    assert back_after(late, since) < 1.0
    again = [t for m, t, _ in late.api.requests if m == "GET" and "watch=true" in t][watches:]
    assert again, "no new watch"
    # Its own writes are no news: no relist for them, and no warning.
    assert late.node.log_text().count("by someone else") == 2  # the wipe, and the delete above
