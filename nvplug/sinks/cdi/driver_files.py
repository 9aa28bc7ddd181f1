"""Finding what the driver installed: its libraries (through the ldconfig cache), binaries,
firmware and sockets under the driver root, and the device nodes under the dev root.

Nothing is hard-coded but the names NVIDIA's own generator looks for: the libraries
are every `*.so.<driver version>` in the directories where the cache finds the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from nvplug.cdi.cdi_spec import IMEX_CHANNELS, OPTIONAL_CLASSES, DriverFiles
from nvplug.core.device_nodes import CONTROL_NODES
from nvplug.sinks.cdi import ld_cache as ldcache

LD_CACHE = "etc/ld.so.cache"
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin")
FIRMWARE_DIRS = ("/lib/firmware/nvidia", "/usr/lib/firmware/nvidia")
SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
# How many symlinks deep a library link may go before we call it a loop.
MAX_LINKS = 8


def discover(root: Path, version: str | None) -> DriverFiles:
    """The driver's files under `root` (the driver root as this process sees it), as container paths."""
    problems: list[str] = []
    libraries: tuple[str, ...] = ()
    links: dict[str, str] = {}
    firmware: list[str] = []
    if version is None:
        problems.append("the driver version is unknown, so its libraries and firmware cannot be told apart")
    else:
        libraries, links = _libraries(root, version, problems)
        for d in FIRMWARE_DIRS:
            firmware += sorted(_rel(root, p) for p in (_at(root, d) / version).glob("gsp*.bin"))
        if not firmware:
            problems.append(f"no GSP firmware under {_at(root, FIRMWARE_DIRS[0]) / version}")
    binaries = []
    for name in BINARIES:
        found = next((f"{d}/{name}" for d in BINARY_DIRS if _at(root, f"{d}/{name}").is_file()), None)
        if found is not None:
            binaries.append(found)
    sockets = tuple(s for s in SOCKETS if _at(root, s).is_socket())
    firmware = list(dict.fromkeys(firmware))
    return DriverFiles(version, libraries, links, tuple(binaries), tuple(firmware), sockets, tuple(problems))


def _libraries(root: Path, version: str, problems: list[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Every `*.so.<version>` beside a library of this driver in the ld cache, and the SONAME links to them."""
    cache = root / LD_CACHE
    try:
        entries = ldcache.read(cache)
    except (OSError, ldcache.LdCacheError) as err:
        problems.append(f"cannot read the ld cache {cache}: {err}")
        return (), {}
    suffix = f".so.{version}"
    links: dict[str, str] = {}
    folders: set[str] = set()
    for entry in entries:
        target = _resolve(root, entry.path)
        if target is not None and target.endswith(suffix):
            folders.add(str(PurePosixPath(target).parent))
            if target != entry.path:
                links[entry.path] = target
    if not folders:
        problems.append(f"the ld cache {cache} lists no library of driver {version}")
    libraries = sorted(_rel(root, p) for f in folders for p in _at(root, f).glob(f"*{suffix}"))
    return tuple(libraries), links


def _resolve(root: Path, path: str) -> str | None:
    """Follow a link as it would be followed with `root` as /; None if it leads nowhere."""
    for _ in range(MAX_LINKS):
        full = _at(root, path)
        if not full.is_symlink():
            return path if full.is_file() else None
        target = str(full.readlink())
        path = target if target.startswith("/") else str(PurePosixPath(path).parent / target)
    return None


def control_nodes(dev_root: Path) -> list[str]:
    return [p for p in CONTROL_NODES if _at(dev_root, p).exists()]


def optional_nodes(dev_root: Path, classes: Sequence[str]) -> dict[str, list[str]]:
    """The nodes of each enabled optional class (gds, mofed, gdrcopy) that exist."""
    return {
        cls: sorted(_rel(dev_root, p) for g in OPTIONAL_CLASSES[cls] for p in dev_root.glob(g.lstrip("/")))
        for cls in classes
    }


def imex_nodes(dev_root: Path, channel_ids: Sequence[int]) -> Mapping[int, str]:
    paths = {i: f"{IMEX_CHANNELS}/channel{i}" for i in channel_ids}
    return {i: p for i, p in paths.items() if _at(dev_root, p).exists()}


def _at(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _rel(root: Path, full: Path) -> str:
    """A path found under `root` as the container sees it."""
    return "/" + str(Path(full).relative_to(root))
