"""MPS end to end with a real runtime: a container of UID 1001 given what nvplug hands out (the Allocate
response's env and mounts, or the CDI names alone) reaches its group's control daemon, gets a server
of its own UID, and shares the group's shm tmpfs.

The daemon runs nvplug's MPS group as on a host (the control daemon stand-in as its child, the shm
tmpfs mounted in this mount namespace); podman runs in a private mount namespace made from this one,
so the container sees the same tmpfs and the same pipe directory. The client inside the container is
the stand-in's static binary: its `--fake-cuda-client` makes the control daemon start a server that
switches to the client's UID and connects back to the pipe directory on the host.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from support import podman
from test_cdi_podman import read_spec, real_device_nodes
from test_mps import FOUR_ON_TWO, GROUP, MPS_RESOURCE, TIMEOUT, allocatable, group, pipe_dir, status

from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing import mps_control_standin as mps
from nvplug.testing.simulated_node import SimulatedNode

UNAVAILABLE = podman.podman_available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"cannot run containers: {UNAVAILABLE}")

USER = 1001
CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
# Where the client binary is inside the container: where the CDI spec's driver mounts put it.
CONTAINER_BINARY = f"/usr/bin/{mps.BINARY_NAME}"
# 81559 MiB / 4 replicas, device 0 of what the container sees.
PINNED = "0=20389M"
LIMITS = "    clientLimits: true\n"
HOST_MARK = "from-host"
CONTAINER_MARK = "from-container"
CONNECTED = re.compile(
    r"^connected to MPS server (\d+) \(user (\d+), active thread percentage ([\d.]+), "
    r"pinned memory limits ([^)]*)\)$"
)

# Busybox's applets the image has no link for are called through busybox itself.
_CLIENT_SCRIPT = """echo '== id'
busybox id -u; busybox id -g
echo '== env'
env | busybox sort | busybox grep '^CUDA_MPS_'
echo '== binary'
command -v nvidia-cuda-mps-control
echo '== percentage'
echo get_default_active_thread_percentage | nvidia-cuda-mps-control; echo "rc=$?"
echo '== cuda'
nvidia-cuda-mps-control --fake-cuda-client; echo "rc=$?"
echo '== shm'
cat /dev/shm/HOST_MARK
echo "written by $(busybox id -u)" > /dev/shm/CONTAINER_MARK; echo "rc=$?"
busybox awk '$5 == "/dev/shm" { print $5, $(NF-2) }' /proc/self/mountinfo
echo '== pipe'
stat -c '%n %F %a' "$CUDA_MPS_PIPE_DIRECTORY/control"
echo '== end'
""".replace("HOST_MARK", HOST_MARK).replace("CONTAINER_MARK", CONTAINER_MARK)


@pytest.fixture
def store(short_tmp: Path) -> Iterator[podman.PodmanStore]:
    with podman.PodmanStore(short_tmp / "pm") as s:
        yield s


@pytest.fixture
def mps_node(node: SimulatedNode) -> Iterator[SimulatedNode]:
    """The node, its daemon stopped with SIGTERM at the end: its control daemons quit (they run in
    sessions of their own, which a SIGKILL of nvplug would leave behind) and the shm is unmounted."""
    yield node
    if node.daemon is not None and node.daemon.poll() is None:
        node.stop_daemon()


def start(node: SimulatedNode, config: str) -> list[str]:
    node.config.write_text(config)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(allocatable(8), TIMEOUT)
    return [g["uuid"] for g in node.scenario_gpus()]


def sections(stdout: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = found.setdefault(line[3:], [])
        elif current is not None and line.strip():
            current.append(line)
    return found


def mount_fstype(path: Path) -> str | None:
    """The file system type of the mount at `path` in this mount namespace; None: not a mount point."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            return line.split(" - ", 1)[1].split()[0]
    return None


def ids_of(pid: int) -> tuple[list[int], list[int]]:
    """A process's real, effective, saved and file-system UIDs and GIDs."""
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return [int(v) for v in lines["Uid"].split()], [int(v) for v in lines["Gid"].split()]


def run_client(
    store: podman.PodmanStore,
    node: SimulatedNode,
    *,
    devices: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    label: str,
) -> tuple[dict[str, list[str]], str]:
    """Write the host's mark into the shm, run the client script as UID 1001; its sections and the
    failure context. The output is printed (pytest -s shows it)."""
    shm = node.mps_root / "shm"
    (shm / HOST_MARK).write_text("written on the host\n")
    image = podman.import_busybox(store)
    result = podman.run_container(
        store,
        image,
        _CLIENT_SCRIPT,
        devices=devices,
        cdi_spec_dir=node.cdi_dir,
        extra_args=["--user", f"{USER}:{USER}", *extra_args],
        timeout=60,
    )
    context = result.describe()
    print(f"\n--- container output ({label}, --user {USER}:{USER}) ---\n{result.stdout}{result.stderr}")
    assert result.returncode == 0, context
    assert result.stdout.rstrip().endswith("== end"), context
    return sections(result.stdout), context


def check_client(node: SimulatedNode, found: Mapping[str, list[str]], context: str) -> None:
    """What the container saw, and what the host sees of its server afterwards."""
    pipe = pipe_dir(node)
    shm = node.mps_root / "shm"
    assert found["id"] == [str(USER), str(USER)], context
    assert found["env"] == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={PINNED}",
        f"CUDA_MPS_PIPE_DIRECTORY={pipe}",
    ], context
    assert found["binary"] == [CONTAINER_BINARY], context
    # The defaults nvplug set before the devices turned Healthy: 100 / 4 replicas.
    assert found["percentage"] == ["25.0", "rc=0"], context
    assert found["pipe"] == [f"{pipe}/control socket 666"], context
    # A server of the container's UID, started on the host, with the group's defaults.
    connected, rc = found["cuda"]
    assert rc == "rc=0", context
    match = CONNECTED.match(connected)
    assert match is not None, context
    server = int(match[1])
    assert (int(match[2]), float(match[3]), match[4]) == (USER, 25.0, "0=20389M,1=20389M"), context
    # The group's tmpfs is the container's /dev/shm, both ways.
    assert found["shm"] == ["written on the host", "rc=0", "/dev/shm tmpfs"], context
    assert mount_fstype(shm) == "tmpfs"
    written = shm / CONTAINER_MARK
    assert written.read_text() == f"written by {USER}\n", context
    assert (written.stat().st_uid, written.stat().st_gid) == (USER, USER)
    assert stat.S_IMODE(shm.stat().st_mode) == 0o1777
    # On the host: the daemon lists that server, and it runs as UID 1001.
    listed = mps.client(pipe, "get_server_list", binary=node.mps_control, timeout=5)
    assert (listed.returncode, listed.stdout.split()) == (0, [str(server)]), listed
    uids, gids = ids_of(server)
    assert uids == [USER] * 4 and gids == [USER] * 4, (uids, gids)
    assert mps.client(pipe, f"get_server_status {server}", binary=node.mps_control, timeout=5).stdout == "ACTIVE\n"


def test_a_uid_1001_container_given_the_allocate_response_gets_its_own_server(
    mps_node: SimulatedNode, store: podman.PodmanStore
) -> None:
    node = mps_node
    uuids = start(node, node.mps_config(FOUR_ON_TWO, LIMITS))
    response = node.kubelet.allocate(MPS_RESOURCE, [f"{uuids[0]}::0"])
    (container,) = response.container_responses
    pipe = str(pipe_dir(node))
    assert dict(container.envs) == {
        "NVIDIA_VISIBLE_DEVICES": uuids[0],
        "CUDA_MPS_PIPE_DIRECTORY": pipe,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": PINNED,
    }
    mounts = {m.container_path: (m.host_path, m.read_only) for m in container.mounts}
    assert mounts == {pipe: (pipe, False), "/dev/shm": (str(node.mps_root / "shm"), False)}
    args = [word for k, v in sorted(container.envs.items()) for word in ("-e", f"{k}={v}")]
    for m in container.mounts:
        args += ["-v", f"{m.host_path}:{m.container_path}" + (":ro" if m.read_only else "")]
    args += ["-v", f"{node.mps_control}:{CONTAINER_BINARY}:ro"]

    found, context = run_client(store, node, extra_args=args, label="the Allocate response's -e and -v")

    check_client(node, found, context)
    assert group(node)["up"]


def test_the_cdi_names_alone_give_a_uid_1001_container_the_same(
    mps_node: SimulatedNode, store: podman.PodmanStore, short_tmp: Path
) -> None:
    node = mps_node
    drv = driverroot.build(short_tmp / "drv")
    # The stand-in in place of the driver's binary, before the daemon starts: nvplug runs it (no
    # controlPath: the driver root's), and the spec's driver mounts carry it into the container.
    mps.install(drv.root / "usr" / "bin", build_dir=node.lib_dir / "mps-control")
    real_device_nodes(node)
    config: dict[str, Any] = yaml.safe_load(node.mps_config(FOUR_ON_TWO, LIMITS))
    del config["nvplug"]["mps"]["controlPath"]
    config["flags"] = {"nvidiaDriverRoot": str(drv.root), "plugin": {"deviceListStrategy": "cdi-cri"}}
    uuids = start(node, yaml.safe_dump(config))
    binary = drv.root / CONTAINER_BINARY.lstrip("/")
    assert Path(f"/proc/{group(node)['pid']}/exe").readlink() == binary

    response = node.kubelet.allocate(MPS_RESOURCE, [f"{uuids[0]}::0"])
    (container,) = response.container_responses
    names = [d.name for d in container.cdi_devices]
    assert names == [f"{CDI_KIND}={uuids[0]}"]
    spec, spec_text = read_spec(node)
    shared = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert shared[CONTAINER_BINARY] == str(binary), spec_text
    entry = next(d for d in spec["devices"] if d["name"] == uuids[0])["containerEdits"]
    pipe = str(pipe_dir(node))
    assert sorted(entry["env"]) == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={PINNED}",
        f"CUDA_MPS_PIPE_DIRECTORY={pipe}",
    ], spec_text
    assert {m["containerPath"]: m["hostPath"] for m in entry["mounts"]} == {
        pipe: pipe,
        "/dev/shm": str(node.mps_root / "shm"),
    }, spec_text
    # The other GPU of the group: its own entry, the same daemon.
    other = next(d for d in spec["devices"] if d["name"] == uuids[1])["containerEdits"]
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in other["env"], spec_text

    found, context = run_client(store, node, devices=names, label=f"--device {names[0]} alone")

    check_client(node, found, f"{context}\n--- CDI spec ---\n{spec_text}")
    assert group(node)["up"]


def test_a_root_parent_of_mode_0700_keeps_the_group_down_naming_it(mps_node: SimulatedNode) -> None:
    """What breaks NVIDIA's plugin for non-root clients (#762): a server of the client's UID cannot
    pass a 0700 parent of the pipe directory. nvplug refuses to start the group instead."""
    node = mps_node
    config = node.mps_config(FOUR_ON_TWO, LIMITS)
    node.root.chmod(0o700)  # after mps_config, which makes it 0755
    node.config.write_text(config)
    node.kubelet.start()
    node.start_daemon()
    node.wait_log("is down:")
    node.kubelet.wait_for(allocatable(0), TIMEOUT)
    plugin = node.kubelet.plugin(MPS_RESOURCE)
    assert plugin is not None and plugin.capacity == 8
    assert not any(d.healthy for d in plugin.devices.values())
    assert all(not d.healthy for u in plugin.updates for d in u.devices)
    # The whole GPUs outside the group are served as ever.
    node.kubelet.wait_for(allocatable(6, "nvidia.com/gpu"), TIMEOUT)
    found = status(node)["groups"]
    assert [g["name"] for g in found] == [GROUP]
    error = found[0]["last_error"]
    assert found[0]["up"] is False and found[0]["pid"] is None
    assert f"{node.root} is mode 0700" in error and str(node.mps_root) in error, error
    # No control daemon was started, so no server could ever have failed as NVIDIA's do.
    assert not (pipe_dir(node) / "control").exists()
    assert not mps.commands(node.mps_root / GROUP / "log")
    # The kubelet's Allocate of such a device says why.
    uuid = node.scenario_gpus()[0]["uuid"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        node.kubelet.allocate(MPS_RESOURCE, [f"{uuid}::0"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert f"is Unhealthy: its MPS control daemon is down: {error}" in details, details
    print(f"\nAllocate refused: {details}")
    # Made traversable, the group comes up at its next try, with nothing else done.
    node.root.chmod(0o755)
    node.kubelet.wait_for(allocatable(8), TIMEOUT)
    found = group(node)
    assert found["up"] and found["last_error"] is None and found["pid"] > 0
