"""`nvplug demo`: the real daemon against a simulated 8-GPU node, narrated."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing import nvidia_smi_standin as nvidia_smi
from nvplug.testing.fakenvml_library import FakeNvmlBuildError
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

STEP_TIMEOUT = 15.0
DEMO_CONFIG = """version: v1
flags:
  nvidiaDriverRoot: {driver_root}
  plugin:
    deviceListStrategy: [envvar, cdi-cri]
nvplug:
  health:
    reprobeInitialSeconds: 0.5
    reprobeMaxSeconds: 1
"""
CDI_SPEC = "k8s.device-plugin.nvidia.com-gpu.json"


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
        # A driver root of real (tiny) libraries: the CDI spec mounts them into containers.
        drv = driverroot.build(root / "driver")
        # Short re-probe backoff, so a lost GPU's re-probes show in a demo.
        node.config.write_text(DEMO_CONFIG.format(driver_root=drv.root))
        # NFD's features.d, where nvplug writes the node labels.
        node.features_dir.mkdir()
        node.kubelet.start()
        # The daemon logs at info (the demo quotes its reasons); the user sees what they asked for.
        node.start_daemon(log_level="info", echo=functools.partial(_echo, logging.getLevelName(log_level.upper())))

        node.kubelet.wait_for(registered_with(8), STEP_TIMEOUT)
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
        for name in container.cdi_devices:
            say(f"   cdi    {name.name}")
        doc = json.loads((node.cdi_dir / CDI_SPEC).read_text())
        shared = doc["containerEdits"]
        libcuda = [m["containerPath"] for m in shared["mounts"] if "/libcuda.so." in m["containerPath"]]
        nodes, mounts = len(shared["deviceNodes"]), len(shared["mounts"])
        say(f"   defined in {node.cdi_dir / CDI_SPEC} ({len(doc['devices'])} devices); every container")
        also = f"{nodes} control nodes and {mounts} mounts of driver files"
        say(f"   also gets {also}, {' and '.join(libcuda)} among them")

        victim = ids[-1]
        say()
        say(f"4. XID 79 (GPU has fallen off the bus) on {victim}; NVML answers GPU_IS_LOST for it")
        node.control.xid(victim, 79)
        node.control.lose(victim)
        node.kubelet.wait_for(device_health(victim, healthy=False), STEP_TIMEOUT)
        say(f"   {victim} is Unhealthy: {_allocatable(node)} of 8 allocatable")
        say(f"   {_reason(node.wait_log('unhealthy: XID 79'), victim, 'unhealthy: XID 79')}")
        node.control.restore(victim)
        time.sleep(1.0)
        still = "Unhealthy" if victim not in (node.kubelet.plugin(GPU_RESOURCE) or plugin).healthy_ids else "Healthy?!"
        say(f"   NVML answers for it again, yet it stays {still}: XID 79 needs a reset, and a")
        say("   passing probe is no proof of one. Healthy GPUs are never polled.")
        say(f"   {_waiting(node.log_text(), victim)}")
        index = next(str(n) for n, g in enumerate(node.scenario_gpus()) if g["uuid"] == victim)
        argv = [
            sys.executable,
            "-m",
            "nvplug",
            "heal",
            index,
            "--reset",
            "--status-listen",
            f"unix:{node.status_socket}",
        ]
        say(f"   $ nvplug heal {index} --reset")
        reset = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)
        for line in (done.stdout + done.stderr).splitlines():
            say(f"   {line}")
        node.kubelet.wait_for(device_health(victim, healthy=True), STEP_TIMEOUT)
        took = time.monotonic() - reset
        ran = " ".join(nvidia_smi.calls(node.nvidia_smi_log)[-1])
        say(f"   no process held it, so nvplug ran `nvidia-smi {ran}` (a stand-in here), rescanned,")
        say(f"   and the GPU is Healthy again {took:.1f}s later, {_allocatable(node)} allocatable")
        say(f"   {_reason(node.wait_log('healthy: recovered'), victim, 'healthy: recovered')}")

        say()
        new_uuid = "GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"
        if node.netns is not None:
            say("5. Hot-adding a ninth GPU: udev add and bind of 0000:cc:00.0")
            node.add_gpu(f'uuid={new_uuid} name="NVIDIA H100 80GB HBM3" minor=8 bus=0000:CC:00.0 numa=1')
            added = time.monotonic()
            with node.udev() as udev:
                udev.send(pci_event("add", "0000:cc:00.0", driver=None))
                udev.send(pci_event("bind", "0000:cc:00.0"))
            node.kubelet.wait_for(registered_with(9), STEP_TIMEOUT)
            plugin = node.kubelet.plugin(GPU_RESOURCE)
            assert plugin is not None
            numa = ",".join(map(str, plugin.devices[new_uuid].numa_nodes))
            took = (time.monotonic() - added) * 1000
            say(f"   {new_uuid}  Healthy    NUMA {numa}: in the list {took:.0f} ms later, 9 devices")
            spec = json.loads((node.cdi_dir / CDI_SPEC).read_text())
            defined = "defined" if any(d["name"] == new_uuid for d in spec["devices"]) else "NOT defined"
            say(f"   and {defined} in the CDI spec, which is written before the list that advertises it")
        else:
            # Never on the machine's own netlink, where a real nvplug would hear it.
            say(f"5. Hot-add skipped: {node.no_netns_reason} (udev messages go only to a namespace of the node's own)")

        started = time.monotonic()
        code = node.stop_daemon()
        last = node.kubelet.plugin(GPU_RESOURCE)
        say()
        say(f"6. SIGTERM: nvplug exited with status {code} in {time.monotonic() - started:.2f}s;")
        sent = len(last.updates[-1].devices) if last and last.updates else 0
        say(f"   its last list still held {sent} devices (an empty list would drop capacity)")
        return 0 if code == 0 else 1


def _echo(threshold: int, line: str) -> None:
    """Show a daemon log line if its level (the third field) reaches the threshold."""
    fields = line.split(maxsplit=3)
    level = logging.getLevelName(fields[2]) if len(fields) > 2 else logging.INFO
    if not isinstance(level, int) or level >= threshold:
        print(f"    nvplug | {line}", file=sys.stderr)


def _allocatable(node: SimulatedNode) -> int:
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    return plugin.allocatable if plugin is not None else 0


def _waiting(log: str, uuid: str) -> str:
    """What the daemon says the GPU waits for."""
    line = [ln for ln in log.splitlines() if uuid in ln and "; waiting for " in ln][-1]
    return "log: ... waiting for " + line.split("; waiting for ", 1)[1]


def _reason(log: str, uuid: str, what: str) -> str:
    """The daemon's own words: its last log line about this GPU that says `what`."""
    line = [ln for ln in log.splitlines() if uuid in ln and what in ln][-1]
    return "log: " + line.split(": ", 1)[1]
