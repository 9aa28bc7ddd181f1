"""Who holds NVML's init count: reads share it, a scan that counts the GPUs again takes it alone and goes
first, and a scan left behind while it hung cannot release a later one's hold."""

from __future__ import annotations

import threading

import pytest

from nvplug.nvml.nvml_sessions import NvmlBusy, NvmlSessions


def test_reads_share_and_a_scan_waits_for_them() -> None:
    sessions = NvmlSessions()
    took = threading.Event()
    with sessions.shared(1.0), sessions.shared(1.0):
        scan = threading.Thread(target=lambda: (sessions.take_alone(), took.set()))
        scan.start()
        assert not took.wait(0.2), "a scan took NVML alone while reads held it"
        # A waiting scan goes first: no new read starts.
        with pytest.raises(NvmlBusy), sessions.shared(0.1):
            pass
    assert took.wait(5.0)
    scan.join()


def test_a_read_waits_out_a_short_scan_and_gives_up_on_a_long_one() -> None:
    sessions = NvmlSessions()
    held = sessions.take_alone()
    released = threading.Event()
    threading.Timer(0.1, lambda: (sessions.release_alone(held), released.set())).start()
    with sessions.shared(5.0):  # no NvmlBusy: the share came once the scan let go
        assert released.is_set()
    held = sessions.take_alone()
    with pytest.raises(NvmlBusy), sessions.shared(0.1):
        pass
    sessions.release_alone(held)


def test_an_old_token_releases_nothing() -> None:
    sessions = NvmlSessions()
    old = sessions.take_alone()
    sessions.release_alone(old)
    current = sessions.take_alone()
    sessions.release_alone(old)  # the scan that hung, returning late
    with pytest.raises(NvmlBusy), sessions.shared(0.1):
        pass
    sessions.release_alone(current)
    with sessions.shared(0.1):
        pass
