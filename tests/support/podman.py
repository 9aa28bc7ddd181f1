"""Run a real container with podman, for tests of the CDI specs nvplug writes.

A :class:`PodmanStore` is a podman of its own in one directory: images,
containers, runtime state, locks, events and network state all live there, so
the host's own podman, runc and CDI state are never read or written. Every
podman command runs in a private mount namespace (``unshare --mount
--propagation private``) where the fixed paths podman 4 and runc use whatever
their flags say (``/run/runc``, ``/run/containers``, ``/var/lib/containers``)
are bind mounts of the store's directories, ``/etc/cdi`` is an empty tmpfs and
``/var/run/cdi`` the spec directory under test (bind mounted). The mount points
are made on the host only where missing, and removed again.

The image is a busybox root file system imported with ``podman import``: no
registry is needed. Containers run with runc (crun refuses cgroup v1 hybrid
hosts), limits within the host's hard limits, no network, and a cgroup parent
of the store's own that :meth:`PodmanStore.close` removes.

Needs root, ``podman`` (4.x, with ``conmon``), ``/usr/sbin/runc``, a static
``/bin/busybox``, and ``unshare`` and ``mount`` from util-linux:
:func:`podman_available` says which is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shlex
import shutil
import signal
import struct
import subprocess
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = [
    "APPLETS",
    "BUSYBOX",
    "DEFAULT_IMAGE",
    "RUNC",
    "ULIMITS",
    "PodmanError",
    "PodmanStore",
    "RunResult",
    "build_busybox_rootfs",
    "import_busybox",
    "podman_available",
    "run_container",
]

RUNC = "/usr/sbin/runc"
BUSYBOX = Path("/bin/busybox")
# Linked to busybox in the image's /bin.
APPLETS: tuple[str, ...] = ("sh", "ls", "cat", "env", "stat", "md5sum", "find", "test")
DEFAULT_IMAGE = "localhost/nvplug-busybox:test"
# podman's default rlimits exceed some hosts' hard limits (setrlimit ... Operation not permitted).
ULIMITS: tuple[str, ...] = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
# Where runtimes read CDI specs; podman 4.3 has no setting for them.
ETC_CDI = Path("/etc/cdi")
RUN_CDI = Path("/var/run/cdi")
# Host paths podman or runc use whatever the flags say: the store's own directories replace them.
_FIXED_STATE_DIRS: tuple[tuple[str, Path], ...] = (
    ("runc-state", Path("/run/runc")),  # runc's --root; podman passes none
    ("run-containers", Path("/run/containers")),  # netavark's run directory, for root always this
    ("var-lib-containers", Path("/var/lib/containers")),  # the image copy's blob info cache
)
# Held (flock) while mount points are made and removed, so two stores in parallel do not
# remove one another's. The root directory: it always exists and nothing else locks it.
_LOCK_PATH = Path("/")
_PT_INTERP = 3
_DEFAULT_TIMEOUT = 120.0
# argv: [kind source target]... -- command...; kind is "bind" or "tmpfs" (source unused).
_NAMESPACE_SCRIPT = """set -e
while [ "$1" != -- ]; do
  if [ "$1" = tmpfs ]; then mount -t tmpfs -o mode=0755,size=16m nvplug-private "$3"
  else mount --bind "$2" "$3"; fi
  shift 3
done
shift
exec "$@"
"""


class PodmanError(RuntimeError):
    """A podman command failed; the message has its command line and output."""


@dataclass(frozen=True)
class RunResult:
    """What a command did: its argv, exit status, output and how long it took.

    For podman, `argv` is the podman command line; it ran in the store's mount namespace."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        """The command, its status and output, for a failure message."""
        return (
            f"$ {shlex.join(self.argv)}\n(exit {self.returncode} after {self.seconds:.2f}s)\n"
            f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"
        )

    def check(self) -> RunResult:
        """This result, or PodmanError if the command failed."""
        if self.returncode != 0:
            raise PodmanError(self.describe())
        return self


def podman_available() -> str | None:
    """Why containers cannot be run here, or None if they can."""
    if os.geteuid() != 0:
        return "not root: podman needs root here (device nodes, mounts, cgroups)"
    for tool in ("podman", "conmon", "unshare", "mount"):
        if shutil.which(tool) is None and not any(Path(d, tool).is_file() for d in ("/usr/bin", "/usr/sbin")):
            return f"{tool} is not installed"
    if not os.access(RUNC, os.X_OK):
        return f"{RUNC} is not installed (runc: crun refuses cgroup v1 hybrid hosts)"
    if not BUSYBOX.is_file():
        return f"{BUSYBOX} is not installed (busybox-static)"
    if not _is_static_elf(BUSYBOX):
        return f"{BUSYBOX} is not a statically linked executable (install busybox-static)"
    return None


def _is_static_elf(path: Path) -> bool:
    """An ELF file without a program interpreter: it runs in a root with nothing else in it."""
    try:
        with path.open("rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
                return False
            order = "<" if ident[5] == 1 else ">"
            if ident[4] == 2:  # ELFCLASS64
                (phoff,) = struct.unpack_from(f"{order}Q", ident, 32)
                phentsize, phnum = struct.unpack_from(f"{order}HH", ident, 54)
            else:
                (phoff,) = struct.unpack_from(f"{order}I", ident, 28)
                phentsize, phnum = struct.unpack_from(f"{order}HH", ident, 42)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return False
    if len(table) < phentsize * phnum or phentsize < 4:
        return False
    types = (struct.unpack_from(f"{order}I", table, i * phentsize)[0] for i in range(phnum))
    return _PT_INTERP not in types


def build_busybox_rootfs(dest: Path, busybox: Path = BUSYBOX, applets: Sequence[str] = APPLETS) -> Path:
    """A root file system in `dest`: bin/busybox and `applets` linked to it; returns its tar."""
    dest = Path(dest)
    bin_dir = dest / "rootfs" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(busybox, bin_dir / "busybox")
    (bin_dir / "busybox").chmod(0o755)
    for applet in applets:
        link = bin_dir / applet
        link.unlink(missing_ok=True)
        link.symlink_to("busybox")
    for name in ("dev", "proc", "sys", "etc", "tmp"):
        (dest / "rootfs" / name).mkdir(exist_ok=True)
    (dest / "rootfs" / "tmp").chmod(0o1777)
    tar_path = dest / "rootfs.tar"

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    with tarfile.open(tar_path, "w") as tar:
        tar.add(dest / "rootfs", arcname=".", filter=owned_by_root)
    return tar_path


class PodmanStore:
    """A private podman in `directory` (made if missing); close() removes its containers and cgroups,
    and the directory if `remove`. Keep `directory` short: conmon's sockets live below it."""

    def __init__(self, directory: Path, *, remove: bool = True) -> None:
        self.directory = Path(directory).absolute()
        self.remove = remove
        self.cgroup_parent = f"/nvplug-podman-{secrets.token_hex(4)}"
        self.graph_root = self.directory / "root"
        self.run_root = self.directory / "run"
        self.tmp_dir = self.directory / "tmp"
        self.network_dir = self.directory / "networks"
        self.hooks_dir = self.directory / "hooks"
        self.containers_conf = self.directory / "containers.conf"
        self.storage_conf = self.directory / "storage.conf"
        for d in (self.graph_root, self.run_root, self.tmp_dir, self.network_dir, self.hooks_dir):
            d.mkdir(parents=True, exist_ok=True)
        for name, _ in _FIXED_STATE_DIRS:
            (self.directory / name).mkdir(exist_ok=True)
        # Only these files: the host's containers.conf and storage.conf are not read.
        self.containers_conf.write_text(
            "[containers]\n"
            'netns = "none"\n'
            'log_driver = "k8s-file"\n'
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f'events_logfile_path = "{self.directory / "events.log"}"\n'
            # Not the default shm lock, which lives in the host's /dev/shm.
            'lock_type = "file"\n'
            f'tmp_dir = "{self.tmp_dir}"\n'
            f'volume_path = "{self.directory / "volumes"}"\n'
            f'hooks_dir = ["{self.hooks_dir}"]\n'
            "[network]\n"
            f'network_config_dir = "{self.network_dir}"\n'
        )
        self.storage_conf.write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{self.graph_root}"\nrunroot = "{self.run_root}"\n'
        )

    def global_args(self) -> list[str]:
        """podman's options before the subcommand: this store, not the host's."""
        return [
            "--root", str(self.graph_root),
            "--runroot", str(self.run_root),
            "--tmpdir", str(self.tmp_dir),
            "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "file",
            "--network-config-dir", str(self.network_dir),
            "--hooks-dir", str(self.hooks_dir),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CONTAINERS_CONF"] = str(self.containers_conf)
        env["CONTAINERS_STORAGE_CONF"] = str(self.storage_conf)
        # Where the image copy stages blobs (default /var/tmp).
        env["TMPDIR"] = str(self.tmp_dir)
        return env

    def podman(self, *args: str, cdi_spec_dir: Path | None = None, timeout: float = _DEFAULT_TIMEOUT) -> RunResult:
        """`podman ARGS` with this store, in a private mount namespace; /var/run/cdi there is
        `cdi_spec_dir`, or an empty tmpfs, and /etc/cdi an empty tmpfs."""
        mounts: list[tuple[str, str, Path]] = [
            ("bind", str(self.directory / name), target) for name, target in _FIXED_STATE_DIRS
        ]
        mounts.append(("tmpfs", "-", ETC_CDI))
        if cdi_spec_dir is not None:
            mounts.append(("bind", str(Path(cdi_spec_dir).absolute()), RUN_CDI))
        else:
            mounts.append(("tmpfs", "-", RUN_CDI))
        command = ["podman", *self.global_args(), *args]
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _NAMESPACE_SCRIPT, "nvplug-podman"]
        argv += [word for kind, source, target in mounts for word in (kind, source, str(target))]
        argv += ["--", *command]
        with _mount_points([target for _, _, target in mounts]):
            return _run(argv, self.env(), timeout, shown=command)

    def import_rootfs(self, tar_path: Path, reference: str = DEFAULT_IMAGE) -> str:
        """`podman import` a root file system tar as `reference`; returns the reference."""
        self.podman("import", str(tar_path), reference).check()
        return reference

    def close(self) -> None:
        """Remove every container, the cgroup parent, and (if `remove`) the store directory."""
        with contextlib.suppress(PodmanError, OSError, subprocess.SubprocessError):
            self.podman("rm", "--all", "--force", timeout=60)
        _remove_cgroup(self.cgroup_parent)
        if self.remove:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PodmanStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def import_busybox(store: PodmanStore, reference: str = DEFAULT_IMAGE) -> str:
    """Build the busybox root file system in the store's directory and import it as `reference`."""
    tar_path = build_busybox_rootfs(store.directory / "busybox")
    return store.import_rootfs(tar_path, reference)


def run_container(
    store: PodmanStore,
    image: str,
    script: str,
    *,
    devices: Sequence[str] = (),
    cdi_spec_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = _DEFAULT_TIMEOUT,
) -> RunResult:
    """`podman run --rm ... --device D ... IMAGE sh -c SCRIPT` with runc, the store's cgroup parent and
    no network; `cdi_spec_dir` is the container's /var/run/cdi, so CDI names in `devices` resolve
    from the specs there alone. The result's rc is the container's (or podman's 125-127)."""
    args = [
        "run", "--rm", "--pull", "never",
        "--runtime", RUNC, *ULIMITS,
        "--network", "none", "--log-driver", "k8s-file",
        "--cgroups", "no-conmon", "--cgroup-parent", store.cgroup_parent,
    ]  # fmt: skip
    for device in devices:
        args += ["--device", device]
    args += [*extra_args, image, "sh", "-c", script]
    return store.podman(*args, cdi_spec_dir=cdi_spec_dir, timeout=timeout)


def _run(argv: Sequence[str], env: dict[str, str], timeout: float, shown: Sequence[str]) -> RunResult:
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Its own session: podman and whatever it started that stayed in it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout:.0f}s)\n"
    return RunResult(tuple(shown), proc.returncode, stdout, stderr, time.monotonic() - start)


@contextlib.contextmanager
def _mount_points(targets: Sequence[Path]) -> Iterator[None]:
    """The directories `targets` exist while this lasts; those made here are removed after."""
    lock = os.open(_LOCK_PATH, os.O_RDONLY | os.O_DIRECTORY)
    created: list[Path] = []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for target in targets:
            missing = [p for p in (target, *target.parents) if not p.exists()]
            for path in reversed(missing):
                path.mkdir(mode=0o755)
                created.append(path)
        yield
    finally:
        for path in reversed(created):
            # Left alone if something else put files there meanwhile.
            with contextlib.suppress(OSError):
                path.rmdir()
        os.close(lock)  # releases the lock


def _cgroup_mounts() -> list[Path]:
    """The mount points of every cgroup hierarchy (v1 controllers, named ones and v2) at its root."""
    found: list[Path] = []
    with contextlib.suppress(OSError), Path("/proc/self/mountinfo").open() as f:
        for line in f:
            fields = line.split()
            if " - " not in line or len(fields) < 5:
                continue
            fstype = line.split(" - ", 1)[1].split()[0]
            if fstype in ("cgroup", "cgroup2") and fields[3] == "/":
                found.append(Path(fields[4].replace("\\040", " ")))
    return found


def _remove_cgroup(relative: str, wait: float = 5.0) -> None:
    """Remove the cgroup `relative` (and the empty ones below it) from every hierarchy that has it.
    A cgroup with processes in it cannot go: retried until `wait` runs out, then left."""
    deadline = time.monotonic() + wait
    while True:
        left = []
        for mount in _cgroup_mounts():
            top = mount / relative.lstrip("/")
            if not top.is_dir():
                continue
            below = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for path in [*below, top]:
                try:
                    path.rmdir()
                except OSError:
                    left.append(path)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.1)
