"""Run the kubelet stand-in in the foreground: ``python -m nvplug.testing.kubelet_standin --dir DIR``.

It prints each registration and update; SIGHUP simulates a kubelet restart. The
stand-in itself is ``fake_kubelet.FakeKubelet``; ``kubelet_thread.KubeletThread``
runs one for sync code.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_plugin_client import DIAL_TIMEOUT_S, KubeletError


async def _serve(plugin_dir: Path, dial_timeout: float) -> None:
    start = time.monotonic()

    def emit(line: str) -> None:
        print(f"[{time.monotonic() - start:9.3f}] {line}", flush=True)

    kubelet = FakeKubelet(plugin_dir, dial_timeout=dial_timeout, on_event=emit)
    await kubelet.start()
    emit(f"serving {kubelet.socket_path} (SIGHUP: restart, SIGINT/SIGTERM: stop)")
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    hups: list[asyncio.Task[None]] = []  # strong refs so restarts are not garbage-collected
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: hups.append(loop.create_task(kubelet.restart())))
    try:
        await done.wait()
    finally:
        await kubelet.stop()
        emit("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nvplug.testing.kubelet_standin", description="Run a kubelet device-manager stand-in."
    )
    parser.add_argument("--dir", type=Path, required=True, help="device-plugins directory to serve in")
    parser.add_argument("--dial-timeout", type=float, default=DIAL_TIMEOUT_S, help="dial-back timeout (s)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.dir, args.dial_timeout))
    except KubeletError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
