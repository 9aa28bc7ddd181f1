"""The CDI specs nvplug writes, built from the node's state and the driver's files alone.

Pure: what is on disk comes in as DriverFiles and the dev nodes found; a spec
comes out. The names are NVIDIA's plugin's, so pod specs and policies written
for it keep working: kind k8s.device-plugin.nvidia.com/gpu for whole GPUs and
MIG devices alike, each named by UUID or by index (`2`, `2:1` for MIG).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from nvplug.core.gpu import Gpu, MigDevice, uuid_of
from nvplug.core.mig import CapMinors
from nvplug.shaping.mps_groups import container_view, pipe_dir

VENDOR = "k8s.device-plugin.nvidia.com"
GPU_KIND = f"{VENDOR}/gpu"
IMEX_KIND = f"{VENDOR}/imex-channel"
# The newest version whose features we use (deviceNodes.hostPath came in 0.5.0); containerd 1.7,
# CRI-O 1.24+ and podman 4.x all read it.
CDI_VERSION = "0.5.0"
# A spec file holds no secrets, and every runtime must read it.
SPEC_MODE = 0o644
DIR_MODE = 0o755
ALL = "all"
READ_ONLY = ("ro", "nosuid", "nodev", "bind")
WRITABLE = ("rw", "nosuid", "nodev", "bind")
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"
# Optional classes NVIDIA's plugin offers, by its flags: each a device "all" of the nodes that exist.
OPTIONAL_CLASSES: Mapping[str, tuple[str, ...]] = {
    "gds": ("/dev/nvidia-fs*",),
    "mofed": ("/dev/infiniband/uverbs*", "/dev/infiniband/rdma_cm"),
    "gdrcopy": ("/dev/gdrdrv",),
}

# The snapshot's fields a spec is made of (the device nodes: the control and optional nodes it lists).
CDI_READS = frozenset({"gpus", "cap_minors", "mps", "driver_version", "driver_instance", "device_nodes"})

# One device as a container sees it: a whole GPU, or a MIG device on its GPU.
Unit = tuple[Gpu, MigDevice | None]


def device_name(gpu: Gpu, mig: MigDevice | None, id_strategy: str) -> str:
    """NVIDIA's naming: UUIDs (GPU-... or MIG-...), or indices (`2`, or `2:1` for a GPU's second MIG device)."""
    if id_strategy == "uuid":
        return uuid_of(gpu, mig)
    if mig is None:
        return str(gpu.index)
    return f"{gpu.index}:{gpu.mig.index(mig)}"


def qualified(kind: str, name: str) -> str:
    return f"{kind}={name}"


@dataclass(frozen=True)
class Node:
    path: str
    host_path: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "hostPath": self.host_path}


@dataclass(frozen=True)
class CdiMount:
    container_path: str
    host_path: str
    options: tuple[str, ...] = READ_ONLY

    def as_dict(self) -> dict[str, object]:
        return {"hostPath": self.host_path, "containerPath": self.container_path, "options": list(self.options)}


@dataclass(frozen=True)
class Hook:
    path: str
    args: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {"hookName": "createContainer", "path": self.path, "args": list(self.args)}


@dataclass(frozen=True)
class Edits:
    nodes: tuple[Node, ...] = ()
    mounts: tuple[CdiMount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    env: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.env:
            out["env"] = list(self.env)
        if self.nodes:
            out["deviceNodes"] = [n.as_dict() for n in self.nodes]
        if self.mounts:
            out["mounts"] = [m.as_dict() for m in self.mounts]
        if self.hooks:
            out["hooks"] = [h.as_dict() for h in self.hooks]
        return out


def mps_edits(root: str, group: str, limits: Mapping[str, str] | None = None) -> Edits:
    """What a client of an MPS group gets: the group's pipe directory and the shm, writable, and the
    variable that names the pipe, with `limits` beside it."""
    env, mounts = container_view(pipe_dir(root, group), root)
    return Edits(
        mounts=tuple(CdiMount(inside, host, WRITABLE) for inside, host in mounts),
        env=tuple(f"{k}={v}" for k, v in {**env, **(limits or {})}.items()),
    )


@dataclass(frozen=True)
class CdiSpec:
    kind: str
    devices: Mapping[str, Edits]
    shared: Edits = field(default_factory=Edits)

    @property
    def file_name(self) -> str:
        """CDI's convention: <vendor>-<class>.json."""
        return self.kind.replace("/", "-") + ".json"

    def names(self) -> list[str]:
        return [qualified(self.kind, n) for n in self.devices]

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": [{"name": n, "containerEdits": e.as_dict()} for n, e in self.devices.items()],
        }
        shared = self.shared.as_dict()
        if shared:
            out["containerEdits"] = shared
        return out

    def render(self) -> bytes:
        return (json.dumps(self.as_dict(), indent=2) + "\n").encode()


@dataclass(frozen=True)
class DriverFiles:
    """What the driver installed, as container paths (its root stripped); found by driverfiles.discover."""

    version: str | None = None
    libraries: tuple[str, ...] = ()
    # The SONAME links ldconfig made (libcuda.so.1), and the library each names.
    links: Mapping[str, str] = field(default_factory=dict)
    binaries: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()
    # What could not be found, for the log and doctor.
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Roots:
    """Where the driver's files and nodes are on the host (flags.nvidiaDriverRoot, nvidiaDevRoot)."""

    driver: str = "/"
    dev: str = "/"

    def driver_path(self, path: str) -> str:
        return _under(self.driver, path)

    def dev_path(self, path: str) -> str:
        return _under(self.dev, path)


def _under(root: str, path: str) -> str:
    return str(PurePosixPath(root) / path.lstrip("/"))


def shared_edits(files: DriverFiles, roots: Roots, control_nodes: Sequence[str], hook: str | None) -> Edits:
    """Edits every GPU container gets: control nodes, libraries, binaries, firmware, sockets, hooks.

    With NVIDIA's hook binary (`nvidia-cdi-hook`, or `nvidia-ctk hook`), it makes the SONAME links and
    updates the container's ld cache, as NVIDIA's specs do. Without it, each SONAME link is mounted as
    well, as a copy of its library: libcuda.so.1 then works in the directory the host uses.
    """
    nodes = tuple(Node(p, roots.dev_path(p)) for p in control_nodes)
    files_mounted = [*files.libraries, *files.binaries, *files.firmware]
    mounts = [CdiMount(p, roots.driver_path(p)) for p in files_mounted]
    mounts += [CdiMount(p, roots.driver_path(p), (*READ_ONLY, "noexec")) for p in files.sockets]
    hooks: list[Hook] = []
    if hook is None:
        mounts += [CdiMount(link, roots.driver_path(lib)) for link, lib in sorted(files.links.items())]
    elif files.libraries:
        head = _hook_args(hook)
        cuda = [link for link in files.links if PurePosixPath(link).name == "libcuda.so.1"]
        if cuda:
            dev_link = str(PurePosixPath(cuda[0]).with_name("libcuda.so"))
            hooks.append(Hook(hook, (*head, "create-symlinks", "--link", f"libcuda.so.1::{dev_link}")))
        folders = sorted({str(PurePosixPath(p).parent) for p in files.libraries})
        hooks.append(Hook(hook, (*head, "update-ldcache", *(a for f in folders for a in ("--folder", f)))))
    return Edits(nodes, tuple(mounts), tuple(hooks))


def _hook_args(hook: str) -> tuple[str, ...]:
    """argv[0] and the subcommand: `nvidia-cdi-hook ...`, or the older `nvidia-ctk hook ...`."""
    name = PurePosixPath(hook).name
    return (name,) if name == "nvidia-cdi-hook" else (name, "hook")


def gpu_spec(
    units: Sequence[Unit],
    id_strategy: str,
    cap_minors: CapMinors,
    roots: Roots,
    shared: Edits,
    extra: Mapping[str, Edits] | None = None,
) -> tuple[CdiSpec, dict[str, str]]:
    """One entry per GPU and MIG device, and `all`; the devices left out, by UUID, and why.
    `extra`: more edits of some devices, by UUID (an MPS device's pipe directory and shm)."""
    devices: dict[str, Edits] = {}
    skipped: dict[str, str] = {}
    whole: list[Node] = []
    for gpu, mig in units:
        uuid = uuid_of(gpu, mig)
        node = gpu.device_node
        if node is None:
            skipped[uuid] = f"the minor number of {gpu.label} is unknown, so its device node is too"
            continue
        nodes = [Node(node, roots.dev_path(node))]
        if mig is None:
            whole.append(nodes[0])
        else:
            assert gpu.minor is not None  # device_node is set
            caps = cap_minors.nodes(gpu.minor, mig.gpu_instance, mig.compute_instance)
            if caps is None:
                skipped[uuid] = f"no capability device minors listed for gpu {gpu.minor} gi {mig.gpu_instance}"
                continue
            nodes += [Node(p, roots.dev_path(p)) for p in caps]
        more = (extra or {}).get(uuid, Edits())
        devices[device_name(gpu, mig, id_strategy)] = Edits(tuple(nodes), more.mounts, more.hooks, more.env)
    if whole:
        devices[ALL] = Edits(tuple(dict.fromkeys(whole)))
    return CdiSpec(GPU_KIND, devices, shared), skipped


def optional_specs(found: Mapping[str, Sequence[str]], roots: Roots) -> list[CdiSpec]:
    """The optional classes whose nodes exist (`found`: class -> /dev paths): one device `all` each."""
    return [
        CdiSpec(f"{VENDOR}/{cls}", {ALL: Edits(tuple(Node(p, roots.dev_path(p)) for p in paths))})
        for cls, paths in found.items()
        if paths
    ]


def imex_spec(channels: Mapping[int, str], roots: Roots) -> CdiSpec | None:
    """IMEX channels whose nodes exist (`channels`: id -> /dev path), each a device named by its id."""
    if not channels:
        return None
    return CdiSpec(IMEX_KIND, {str(i): Edits((Node(p, roots.dev_path(p)),)) for i, p in sorted(channels.items())})
