"""CDI end to end with a real runtime: the names Allocate hands out, resolved by podman from the spec
nvplug wrote, give a container exactly the allocated GPUs' device nodes and the driver's files.

The simulated node's /dev/nvidia* are real character devices here (mknod; no driver is needed
to stat them), the driver root is a fake one with real ELF libraries and ld.so.cache, and podman
runs in a private store and mount namespace where /var/run/cdi is the daemon's spec directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import podman

from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing import fakenvml_devices
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with

UNAVAILABLE = podman.podman_available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"cannot run containers: {UNAVAILABLE}")

TIMEOUT = 15.0
SPEC_FILE = "k8s.device-plugin.nvidia.com-gpu.json"
CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
CHAR = "character special file"
NVIDIA_MAJOR = 195
CAPS_MAJOR = 237
# Control nodes as the driver makes them; nvidia-uvm's major is dynamic.
CONTROL_NODES: Mapping[str, tuple[int, int]] = {
    "nvidiactl": (NVIDIA_MAJOR, 255),
    "nvidia-modeset": (NVIDIA_MAJOR, 254),
    "nvidia-uvm": (235, 0),
    "nvidia-uvm-tools": (235, 1),
}
LIBCUDA_LINK = f"/{driverroot.LIB_DIR}/libcuda.so.1"
MIG_PROFILE = "3g.40gb"
MIG_RESOURCE = f"nvidia.com/mig-{MIG_PROFILE}"


@dataclass(frozen=True)
class Inside:
    """What the container saw: its /dev/nvidia* nodes and the spec's mounts."""

    # path -> (file type, major, minor), directories left out
    devices: dict[str, tuple[str, int, int]]
    # path -> (file type, size), or absent if missing
    mounts: dict[str, tuple[str, int]]
    md5: dict[str, str]


@pytest.fixture
def store(short_tmp: Path) -> Iterator[podman.PodmanStore]:
    with podman.PodmanStore(short_tmp / "pm") as s:
        yield s


def mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def real_device_nodes(node: SimulatedNode) -> None:
    """The node's /dev/nvidiaN and control nodes, until now plain files, as character devices."""
    dev = node.dev_root / "dev"
    for gpu in node.scenario_gpus():
        mknod(dev / f"nvidia{gpu['minor']}", NVIDIA_MAJOR, int(gpu["minor"]))
    for name, (major, minor) in CONTROL_NODES.items():
        mknod(dev / name, major, minor)


def write_config(node: SimulatedNode, drv: driverroot.FakeDriverRoot, **flags: str) -> None:
    config = {
        "version": "v1",
        "flags": {"nvidiaDriverRoot": str(drv.root), "plugin": {"deviceListStrategy": "cdi-cri"}, **flags},
    }
    node.config.write_text(yaml.safe_dump(config))


def start(node: SimulatedNode, *ready: tuple[int, str]) -> float:
    """Start the kubelet stand-in and the daemon; wait until each (count, resource) is served."""
    began = time.monotonic()
    node.kubelet.start()
    node.start_daemon()
    for count, resource in ready:
        node.kubelet.wait_for(registered_with(count, resource), TIMEOUT)
    return time.monotonic() - began


def cdi_names(node: SimulatedNode, resource: str, ids: Sequence[str]) -> list[str]:
    """Allocate through the kubelet stand-in; the CDI names of its one container response."""
    response = node.kubelet.allocate(resource, ids)
    assert len(response.container_responses) == 1
    return [d.name for d in response.container_responses[0].cdi_devices]


def read_spec(node: SimulatedNode) -> tuple[dict[str, Any], str]:
    text = (node.cdi_dir / SPEC_FILE).read_text()
    spec: dict[str, Any] = json.loads(text)
    return spec, f"--- CDI spec {node.cdi_dir / SPEC_FILE} ---\n{text}"


def spec_mounts(spec: Mapping[str, Any]) -> dict[str, str]:
    """containerPath -> hostPath of the spec's shared mounts."""
    mounts = spec.get("containerEdits", {}).get("mounts", [])
    return {m["containerPath"]: m["hostPath"] for m in mounts}


_INSPECT = """echo '== devices'
for f in /dev/nvidia* /dev/nvidia-caps/*; do if test -e "$f"; then stat -c '%n %F %t %T' "$f"; fi; done
echo '== mounts'
for p in MOUNTS; do if test -e "$p"; then stat -c '%n %F %s' "$p"; else echo "missing $p"; fi; done
echo '== md5'
for p in MOUNTS; do if test -f "$p"; then md5sum "$p"; fi; done
echo '== end'
"""


def inspect_script(mounts: Sequence[str]) -> str:
    """List /dev/nvidia* (hex major/minor) and stat and checksum every mount path."""
    return _INSPECT.replace("MOUNTS", " ".join(shlex.quote(p) for p in mounts))


def parse(stdout: str) -> Inside:
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = sections.setdefault(line[3:], [])
        elif current is not None and line.strip():
            current.append(line)
    devices: dict[str, tuple[str, int, int]] = {}
    for line in sections.get("devices", []):
        path, *kind, major, minor = line.split()
        if " ".join(kind) != "directory":
            devices[path] = (" ".join(kind), int(major, 16), int(minor, 16))
    mounts: dict[str, tuple[str, int]] = {}
    for line in sections.get("mounts", []):
        if not line.startswith("missing "):
            path, *kind, size = line.split()
            mounts[path] = (" ".join(kind), int(size))
    md5 = {path: digest for digest, path in (line.split(None, 1) for line in sections.get("md5", []))}
    return Inside(devices, mounts, md5)


def host_md5(path: str | Path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def host_kind(path: Path) -> str:
    mode = path.stat().st_mode
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISREG(mode):
        return "regular file" if path.stat().st_size else "regular empty file"
    if stat.S_ISDIR(mode):
        return "directory"
    return f"mode {mode:o}"


def expected_control_nodes() -> dict[str, tuple[str, int, int]]:
    return {f"/dev/{name}": (CHAR, major, minor) for name, (major, minor) in CONTROL_NODES.items()}


def check_driver_files(inside: Inside, spec: Mapping[str, Any], drv: driverroot.FakeDriverRoot, context: str) -> None:
    """Every mount of the spec is in the container as on the host; libcuda.so.1 is the driver's libcuda."""
    mounts = spec_mounts(spec)
    # The spec itself: every driver library, and (no NVIDIA hook here) each SONAME link as a copy.
    for stem, soname in driverroot.DRIVER_LIBRARIES:
        assert f"/{driverroot.LIB_DIR}/{stem}.so.{drv.version}" in mounts, f"{stem} not mounted\n{context}"
        assert f"/{driverroot.LIB_DIR}/{soname}" in mounts, f"{soname} not mounted\n{context}"
    assert not any(driverroot.UNRELATED_LIBRARY[0] in p for p in mounts), f"a library not the driver's\n{context}"
    assert mounts[LIBCUDA_LINK] == str(drv.library("libcuda")), context
    missing = sorted(set(mounts) - set(inside.mounts))
    assert not missing, f"spec mounts missing in the container: {missing}\n{context}"
    for container_path, host_path in mounts.items():
        host = Path(host_path)
        kind, size = inside.mounts[container_path]
        assert kind == host_kind(host), f"{container_path} is a {kind}, on the host a {host_kind(host)}\n{context}"
        if stat.S_ISREG(host.stat().st_mode):
            assert size == host.stat().st_size, f"{container_path}: size {size}\n{context}"
            assert inside.md5.get(container_path) == host_md5(host), f"{container_path}: other content\n{context}"
    assert inside.md5[LIBCUDA_LINK] == host_md5(drv.library("libcuda")), context


def run_inside(
    store: podman.PodmanStore, node: SimulatedNode, names: Sequence[str], spec: Mapping[str, Any], spec_text: str
) -> tuple[Inside, str, float, float]:
    """Import the image and run the inspection with `names` as --device; what it saw, the failure
    context, and the import and run times."""
    began = time.monotonic()
    image = podman.import_busybox(store)
    imported = time.monotonic() - began
    result = podman.run_container(
        store, image, inspect_script(sorted(spec_mounts(spec))), devices=names, cdi_spec_dir=node.cdi_dir
    )
    context = f"{result.describe()}\n{spec_text}"
    print(f"\n--- container output (--device {' --device '.join(names)}) ---\n{result.stdout}{result.stderr}")
    assert result.returncode == 0, f"the container failed\n{context}"
    assert result.stdout.rstrip().endswith("== end"), context
    return parse(result.stdout), context, imported, result.seconds


def test_whole_gpus_get_their_nodes_and_the_driver_files(
    node: SimulatedNode, store: podman.PodmanStore, short_tmp: Path
) -> None:
    drv = driverroot.build(short_tmp / "drv")
    real_device_nodes(node)
    write_config(node, drv)
    registered = start(node, (8, GPU_RESOURCE))

    gpus = node.scenario_gpus()
    chosen = [gpus[2], gpus[5]]
    began = time.monotonic()
    names = cdi_names(node, GPU_RESOURCE, [g["uuid"] for g in chosen])
    allocated = time.monotonic() - began
    assert sorted(names) == sorted(f"{CDI_KIND}={g['uuid']}" for g in chosen)
    spec, spec_text = read_spec(node)
    assert spec["kind"] == CDI_KIND, spec_text

    inside, context, imported, ran = run_inside(store, node, names, spec, spec_text)

    expected = expected_control_nodes()
    expected.update({f"/dev/nvidia{g['minor']}": (CHAR, NVIDIA_MAJOR, int(g["minor"])) for g in chosen})
    gpu_nodes = sorted(p for p in inside.devices if re.fullmatch(r"/dev/nvidia[0-9]+", p))
    assert gpu_nodes == sorted(f"/dev/nvidia{g['minor']}" for g in chosen), f"other GPUs' nodes\n{context}"
    assert inside.devices == expected, context
    check_driver_files(inside, spec, drv, context)
    print(
        f"timings: daemon registered {registered:.2f}s, Allocate {allocated * 1000:.0f}ms, "
        f"image import {imported:.2f}s, podman run {ran:.2f}s"
    )


def test_mig_device_gets_its_parent_and_two_capability_nodes(
    node: SimulatedNode, store: podman.PodmanStore, short_tmp: Path
) -> None:
    drv = driverroot.build(short_tmp / "drv")
    gpus = node.scenario_gpus()
    parent = gpus[1]
    minor = int(parent["minor"])
    lines = [f"{ln} mig=1" if f"uuid={parent['uuid']} " in ln else ln for ln in node.scenario.read_text().splitlines()]
    lines += [f"mig 1 {MIG_PROFILE} gi={gi} ci=0" for gi in (1, 2)]
    node.scenario.write_text("\n".join(lines) + "\n")
    table = {int(g["minor"]): [(gi, 0) for gi in range(1, 8)] for g in gpus}
    fakenvml_devices.write_mig_minors(node.proc_root / "driver/nvidia-caps/mig-minors", table)
    real_device_nodes(node)
    caps = node.dev_root / "dev" / "nvidia-caps"
    # config and monitor, and both MIG devices' GI and CI: the container must get only its own two.
    cap_minors = [1, 2]
    cap_minors += [
        m for gi in (1, 2) for m in (fakenvml_devices.mig_minor(minor, gi), fakenvml_devices.mig_minor(minor, gi, 0))
    ]
    for cap in cap_minors:
        mknod(caps / f"nvidia-cap{cap}", CAPS_MAJOR, cap)
    write_config(node, drv, migStrategy="mixed")
    registered = start(node, (7, GPU_RESOURCE), (2, MIG_RESOURCE))

    mig_uuid = fakenvml_devices.mig_uuid(parent["uuid"], 2, 0)
    began = time.monotonic()
    names = cdi_names(node, MIG_RESOURCE, [mig_uuid])
    allocated = time.monotonic() - began
    assert names == [f"{CDI_KIND}={mig_uuid}"]
    spec, spec_text = read_spec(node)

    inside, context, imported, ran = run_inside(store, node, names, spec, spec_text)

    gi_cap, ci_cap = fakenvml_devices.mig_minor(minor, 2), fakenvml_devices.mig_minor(minor, 2, 0)
    expected = expected_control_nodes()
    expected[f"/dev/nvidia{minor}"] = (CHAR, NVIDIA_MAJOR, minor)
    expected[f"/dev/nvidia-caps/nvidia-cap{gi_cap}"] = (CHAR, CAPS_MAJOR, gi_cap)
    expected[f"/dev/nvidia-caps/nvidia-cap{ci_cap}"] = (CHAR, CAPS_MAJOR, ci_cap)
    gpu_nodes = [p for p in inside.devices if re.fullmatch(r"/dev/nvidia[0-9]+", p)]
    assert gpu_nodes == [f"/dev/nvidia{minor}"], f"other GPUs' nodes\n{context}"
    cap_nodes = sorted(p for p in inside.devices if p.startswith("/dev/nvidia-caps/"))
    assert cap_nodes == sorted([f"/dev/nvidia-caps/nvidia-cap{gi_cap}", f"/dev/nvidia-caps/nvidia-cap{ci_cap}"]), (
        f"not exactly its two capability nodes\n{context}"
    )
    assert inside.devices == expected, context
    check_driver_files(inside, spec, drv, context)
    print(
        f"timings: daemon registered {registered:.2f}s, Allocate {allocated * 1000:.0f}ms, "
        f"image import {imported:.2f}s, podman run {ran:.2f}s"
    )
