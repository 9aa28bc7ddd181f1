"""`nvplug demo`, as the README's quick start runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_shows_every_step_and_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nvplug", "demo"], capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "1. Registered nvidia.com/gpu (API v1beta1)" in out
    assert "2. ListAndWatch: 8 devices, 8 allocatable" in out
    listing = out.split("2. ListAndWatch", 1)[1].split("3. Allocate", 1)[0]
    assert listing.count("Healthy    NUMA 0") == 4 and listing.count("Healthy    NUMA 1") == 4
    assert "3. Allocate 2 GPUs" in out and "NVIDIA_VISIBLE_DEVICES=GPU-" in out
    assert "device /dev/nvidia0 <- " in out and "device /dev/nvidiactl <- " in out
    assert "cdi    k8s.device-plugin.nvidia.com/gpu=GPU-" in out
    assert "k8s.device-plugin.nvidia.com-gpu.json (9 devices)" in out and "/libcuda.so.1 among them" in out
    assert "4. XID 79 (GPU has fallen off the bus)" in out
    assert "is Unhealthy: 7 of 8 allocatable" in out
    assert "unhealthy: XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)" in out
    assert "yet it stays Unhealthy: XID 79 needs a reset" in out
    assert "waiting for a GPU reset (nvidia-smi -r -i 0000:db:00.0) or a reboot, or `nvplug heal 7`" in out
    assert "$ nvplug heal 7 --reset" in out and "is Healthy: recovered: GPU reset by nvidia-smi" in out
    assert "nvplug ran `nvidia-smi -r -i 0000:db:00.0`" in out
    assert "Healthy again" in out and "8 allocatable" in out
    assert "healthy: recovered: GPU reset by nvidia-smi at the request of uid" in out
    if os.geteuid() == 0:
        assert "5. Hot-adding a ninth GPU" in out and "9 devices" in out
        assert "and defined in the CDI spec, which is written before the list" in out
        assert "its last list still held 9 devices" in out
    else:
        assert "5. Hot-add skipped" in out
    assert "6. SIGTERM: nvplug exited with status 0" in out
    # The simulated node reads only its own CDI directories, whatever the machine's hold.
    assert "CDI conflict" not in out + result.stderr
