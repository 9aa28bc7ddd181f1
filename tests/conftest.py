"""Shared rig: a simulated node per test, with one fake NVML build per session."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.notify_socket import NotifySocket

from nvplug.testing import fakenvml_library
from nvplug.testing.net_namespace import NetNamespace
from nvplug.testing.simulated_node import SimulatedNode


@pytest.fixture(scope="session")
def nvml_lib_dir() -> Iterator[Path]:
    # Short paths: unix sockets live below these directories.
    path = Path(tempfile.mkdtemp(prefix="nvp-lib-", dir="/tmp"))
    fakenvml_library.build(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nvp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(short_tmp: Path, nvml_lib_dir: Path) -> Iterator[SimulatedNode]:
    sim = SimulatedNode(short_tmp, lib_dir=nvml_lib_dir)
    try:
        yield sim
    finally:
        sim.close()
        # Shown by pytest only when the test failed.
        print(f"--- daemon log ({sim.log_path}) ---\n{sim.log_text()}")


@pytest.fixture
def notify(short_tmp: Path) -> Iterator[NotifySocket]:
    """A socket where the daemon's sd_notify messages land, as systemd's NOTIFY_SOCKET."""
    sock = NotifySocket(short_tmp / "notify.sock")
    yield sock
    sock.close()


@pytest.fixture
def netns() -> Iterator[NetNamespace]:
    """A network namespace of the test's own, for udev sent and heard in-process (needs root)."""
    with NetNamespace() as ns:
        yield ns
