"""`nvplug demo`: the real daemon against a simulated 8-GPU node, narrated."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from .testing.fakenvml import FakeNvmlBuildError
from .testing.kubelet import FakeKubelet
from .testing.node import GPU_RESOURCE, SimulatedNode

STEP_TIMEOUT = 15.0
XID_TIMEOUT = 3.0


def say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(log_level: str) -> int:
    with tempfile.TemporaryDirectory(prefix="nvplug-demo-", dir="/tmp") as tmp:
        try:
            return _demo(Path(tmp), log_level)
        except FakeNvmlBuildError as err:
            say(f"demo: cannot build the fake NVML library (a C compiler is needed): {err}")
            return 1
        except TimeoutError as err:
            say(f"demo: a step did not happen in time: {err}")
            return 1


def _demo(root: Path, log_level: str) -> int:
    with SimulatedNode(root) as node:
        say(f"Simulated node in {root}: fake NVML library, kubelet stand-in, nvplug as a child process.")
        node.build_library()
        node.kubelet.start()
        node.start_daemon(log_level=log_level, echo=lambda line: print(f"    nvplug | {line}", file=sys.stderr))

        def has_all(k: FakeKubelet) -> bool:
            p = k.plugin(GPU_RESOURCE)
            return p is not None and p.capacity == 8

        node.kubelet.wait_for(has_all, STEP_TIMEOUT)
        plugin = node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None
        reg = next(r for r in node.kubelet.registrations if r.accepted)
        say()
        say(f"1. Registered {reg.resource} (API {reg.version}) with endpoint {reg.endpoint}")
        preferred = plugin.options.get_preferred_allocation_available
        say(f"   The kubelet dialled back; preferred allocation available: {preferred}")

        say()
        say(f"2. ListAndWatch: {plugin.capacity} devices, {plugin.allocatable} allocatable")
        for device in plugin.devices.values():
            numa = ",".join(map(str, device.numa_nodes)) or "-"
            say(f"   {device.id}  {device.health:<9}  NUMA {numa}")

        ids = list(plugin.healthy_ids)
        picked = node.kubelet.preferred_allocation(GPU_RESOURCE, ids, [], 2)
        response = node.kubelet.allocate(GPU_RESOURCE, picked)
        say()
        say(f"3. Allocate {len(picked)} GPUs (GetPreferredAllocation chose {', '.join(picked)}):")
        container = response.container_responses[0]
        for key, value in sorted(container.envs.items()):
            say(f"   env    {key}={value}")
        for spec in container.devices:
            say(f"   device {spec.container_path} <- {spec.host_path} ({spec.permissions})")

        victim = ids[-1]
        say()
        say(f"4. Injecting XID 79 (GPU has fallen off the bus) on {victim}")
        node.control.xid(victim, 79)

        def unhealthy(k: FakeKubelet) -> bool:
            p = k.plugin(GPU_RESOURCE)
            return p is not None and victim in p.devices and not p.devices[victim].healthy

        try:
            node.kubelet.wait_for(unhealthy, XID_TIMEOUT)
            plugin = node.kubelet.plugin(GPU_RESOURCE)
            assert plugin is not None
            say(f"   {victim} is now Unhealthy: {plugin.allocatable} of {plugin.capacity} allocatable")
        except TimeoutError:
            say(f"   {victim} is still Healthy: NVML health events are not handled yet (event-driven core to come)")

        started = time.monotonic()
        code = node.stop_daemon()
        last = node.kubelet.plugin(GPU_RESOURCE)
        say()
        say(f"5. SIGTERM: nvplug exited with status {code} in {time.monotonic() - started:.2f}s;")
        sent = len(last.updates[-1].devices) if last and last.updates else 0
        say(f"   its last list still held {sent} devices (an empty list would drop capacity)")
        return 0 if code == 0 else 1
