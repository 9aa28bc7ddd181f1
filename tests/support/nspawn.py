"""Boot a real systemd in a throwaway systemd-nspawn container, for the install test.

A Debian root made by debootstrap is cached once (:func:`ensure_image`); each
:class:`Container` boots a disposable snapshot of it, waits until systemd says
the system is up, runs commands inside with ``nsenter`` and, whatever happens,
powers off, kills what is left and removes the snapshot.

The snapshot is an overlay mount made inside the container's own mount
namespace (``unshare --mount`` then ``exec systemd-nspawn``), so the host never
sees the mount and nothing is left mounted when the container dies; where the
cache's file system cannot be an overlay's upper layer it falls back to a copy.

Everything here needs root, ``systemd-nspawn`` (Debian's ``systemd-container``),
``nsenter``, ``unshare`` and ``setpriv`` (``util-linux``) and, to build the image,
``debootstrap`` with network access to a Debian mirror: ``$NVPLUG_DEBIAN_MIRROR``,
else the host's own, found in its apt sources (:func:`debian_mirror`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

from support.waiting import wait_until

__all__ = [
    "APT_ROOT",
    "DEFAULT_CACHE",
    "IMAGE_PACKAGES",
    "MIRROR_ENV",
    "SUITE",
    "AptSource",
    "Bind",
    "Container",
    "ContainerError",
    "Mirror",
    "MirrorError",
    "apt_sources",
    "cache_dir",
    "debian_mirror",
    "ensure_image",
    "missing_requirements",
    "pick_debian_mirror",
    "wait_until",
]

DEFAULT_CACHE = Path("/var/cache/nvplug-test")
SUITE = "bookworm"
# Where debootstrap downloads from when set; else the mirror in the host's apt sources.
MIRROR_ENV = "NVPLUG_DEBIAN_MIRROR"
APT_ROOT = Path("/etc/apt")
# What the image holds besides minbase: an init, a bus, and what the deb depends on,
# so that installing it needs no download.
# rpm: the RPM's scriptlets run there too (Debian's rpm, with its own empty database).
IMAGE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "python3.11-venv", "libudev1", "rpm",
)  # fmt: skip
# Files a finished image has; debootstrap leaves its own directory behind when it fails. An image cached
# before a package was added lacks its marker, and is built again.
_IMAGE_MARKERS = ("usr/lib/systemd/systemd", "usr/bin/python3", "usr/bin/rpm")
# Host tools: what each one comes from on Debian.
HOST_TOOLS = {
    "systemd-nspawn": "systemd-container",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "setpriv": "util-linux",
    "debootstrap": "debootstrap",
}
# The environment of every command run inside: nothing leaks in from the host.
CONTAINER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "HOME": "/root",
    "DEBIAN_FRONTEND": "noninteractive",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}
_RUN_PREFIX = "run-"
_CGROUP_FS = Path("/sys/fs/cgroup")
_CGROUP_PREFIX = "nvplug-nspawn-"

Log = Callable[[str], None]


class ContainerError(RuntimeError):
    """The container could not be built, booted, or a command inside it failed."""


class MirrorError(ContainerError):
    """No Debian mirror to build the image from, or apt sources that cannot be read."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """``$NVPLUG_NSPAWN_CACHE`` or /var/cache/nvplug-test."""
    return Path(os.environ.get("NVPLUG_NSPAWN_CACHE") or DEFAULT_CACHE)


def missing_requirements(cache: Path | None = None) -> str | None:
    """Why containers cannot run here (a skip reason), or None when they can.

    debootstrap is only needed while no image is cached.
    """
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, nsenter and debootstrap run as root)"
    image = (cache or cache_dir()) / SUITE
    need = [tool for tool in HOST_TOOLS if shutil.which(tool) is None]
    if "debootstrap" in need and _image_complete(image):
        need.remove("debootstrap")
    if need:
        packages = sorted({HOST_TOOLS[t] for t in need})
        return f"missing {', '.join(need)} (apt-get install {' '.join(packages)})"
    return None


# ---------------------------------------------------------------------------
# The Debian mirror: the host's own, from its apt sources
# ---------------------------------------------------------------------------

# Suites whose archive also carries SUITE: the release aliases and the releases after it.
# Older releases move to an archive server that no longer has SUITE.
_ARCHIVE_SUITES = frozenset({SUITE, "oldstable", "stable", "testing", "unstable", "sid", "trixie", "forky", "duke"})
# Pockets kept in the same archive as their release (dists/bookworm-updates beside
# dists/bookworm). -security is not one: it is a separate archive, without SUITE itself.
_SAME_ARCHIVE_POCKETS = frozenset({"updates", "backports", "proposed-updates"})
# What debootstrap can download from; cdrom:, file:, mirror+file: and the like are skipped.
_NETWORK_SCHEMES = ("http://", "https://")
# apt ignores files in sources.list.d whose names have other characters (editor backups, ...).
_PART_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# "deb [opt=value ...] uri suite [component ...]"; the option block is optional.
_ONE_LINE = re.compile(r"(?P<type>[^\s\[]+)\s*(?:\[(?P<options>[^\]]*)\]\s*)?(?P<rest>.*)")
_FALSE = frozenset({"no", "false", "off", "0"})


@dataclass(frozen=True)
class AptSource:
    """One enabled ``deb`` entry of the host's apt sources: an archive URI and one suite of it."""

    uri: str
    suite: str
    components: tuple[str, ...]
    where: str  # file:line, for messages

    def __str__(self) -> str:
        return " ".join((self.uri, self.suite, *self.components)) + f" ({self.where})"


@dataclass(frozen=True)
class Mirror:
    """The archive debootstrap downloads from, and where that choice came from."""

    uri: str
    origin: str  # $NVPLUG_DEBIAN_MIRROR, or the file:line of the apt entry


def apt_sources(apt_root: Path = APT_ROOT) -> list[AptSource]:
    """The enabled ``deb`` entries of apt's sources under `apt_root`, in apt's order:
    ``sources.list`` (one-line format), then ``sources.list.d/*.list`` (one-line) and
    ``*.sources`` (deb822) by name.

    deb-src entries, stanzas with ``Enabled: no`` and missing files are left out; an
    entry that apt itself would refuse raises MirrorError naming its file and line.
    """
    parts = apt_root / "sources.list.d"
    names = sorted(
        p.name for pattern in ("*.list", "*.sources") for p in parts.glob(pattern) if _PART_NAME.fullmatch(p.name)
    )
    found: list[AptSource] = []
    for path in [apt_root / "sources.list", *(parts / name for name in names)]:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue  # apt does without them too
        except OSError as err:
            raise MirrorError(f"{path}: cannot read it: {err.strerror or err}") from err
        found += _parse_deb822(path, text) if path.suffix == ".sources" else _parse_one_line(path, text)
    return found


def _parse_one_line(path: Path, text: str) -> list[AptSource]:
    found: list[AptSource] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()  # apt ends a line at its first '#'
        if not line:
            continue
        where = f"{path}:{number}"
        match = _ONE_LINE.fullmatch(line)
        if match is None:  # it starts with '[': no type
            raise MirrorError(f"{where}: no type (deb or deb-src) before the options: {raw.strip()!r}")
        kind, rest = match["type"], match["rest"]
        if rest.startswith("["):
            raise MirrorError(f"{where}: the option block '[' is not closed: {raw.strip()!r}")
        if kind not in ("deb", "deb-src"):
            raise MirrorError(f"{where}: unknown type {kind!r} (deb or deb-src): {raw.strip()!r}")
        fields = rest.split()
        if len(fields) < 2:
            raise MirrorError(f"{where}: needs a URI and a suite after {kind!r}: {raw.strip()!r}")
        if kind == "deb":
            found.append(AptSource(fields[0], fields[1], tuple(fields[2:]), where))
    return found


def _parse_deb822(path: Path, text: str) -> list[AptSource]:
    found: list[AptSource] = []
    for start, fields in _stanzas(path, text):
        where = f"{path}:{start}"
        if fields.get("enabled", "yes").strip().lower() in _FALSE:
            continue
        types, uris, suites = (fields.get(name, "").split() for name in ("types", "uris", "suites"))
        missing = [name for name, value in (("Types", types), ("URIs", uris), ("Suites", suites)) if not value]
        if missing:
            raise MirrorError(f"{where}: the stanza has no {', '.join(missing)}")
        unknown = sorted(set(types) - {"deb", "deb-src"})
        if unknown:
            raise MirrorError(f"{where}: unknown type {', '.join(unknown)} (deb or deb-src)")
        if "deb" in types:
            components = tuple(fields.get("components", "").split())
            found += [AptSource(uri, suite, components, where) for uri in uris for suite in suites]
    return found


def _stanzas(path: Path, text: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(first line, fields by lower-case name) for each stanza; continuation lines
    (an embedded Signed-By key, say) are joined to their field."""
    fields: dict[str, str] = {}
    start = 0
    last: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield start, fields
            fields, last = {}, None
        elif line[0] in " \t":
            if last is None:
                raise MirrorError(f"{path}:{number}: a continuation line outside any field: {line!r}")
            fields[last] += "\n" + line.strip()
        else:
            name, colon, value = line.partition(":")
            if not colon or not name.strip():
                raise MirrorError(f"{path}:{number}: not a 'Field: value' line: {line!r}")
            if not fields:
                start = number
            last = name.strip().lower()
            fields[last] = value.strip()
    if fields:
        yield start, fields


def pick_debian_mirror(sources: Iterable[AptSource], suite: str = SUITE) -> AptSource | None:
    """The entry to debootstrap `suite` from, or None: among the http(s) entries with
    ``main``, the first of `suite` itself, else of an alias or a later release (same
    archive), else of such a release's -updates or -backports pocket (same archive).
    Within each of these, an entry whose URI path ends in ``/debian`` comes first.

    Never a -security suite: that archive holds only security updates.
    """

    def tier(source: AptSource) -> int | None:
        if not source.uri.lower().startswith(_NETWORK_SCHEMES) or "main" not in source.components:
            return None  # not downloadable, or not the Debian archive (third-party repositories lack main)
        if source.suite == suite:
            return 0
        if source.suite in _ARCHIVE_SUITES:
            return 1
        release, dash, pocket = source.suite.partition("-")
        if dash and pocket in _SAME_ARCHIVE_POCKETS and (release == suite or release in _ARCHIVE_SUITES):
            return 2
        return None

    def off_path(source: AptSource) -> bool:
        # Mirrors serve the Debian archive at .../debian; a third-party repository that also
        # names the suite and main rarely sits there.
        return not source.uri.rstrip("/").lower().endswith("/debian")

    ranked = [(t, off_path(s), i, s) for i, s in enumerate(sources) if (t := tier(s)) is not None]
    return min(ranked, key=lambda r: r[:3])[3] if ranked else None


def debian_mirror(apt_root: Path = APT_ROOT, *, environ: Mapping[str, str] | None = None, suite: str = SUITE) -> Mirror:
    """The mirror to debootstrap `suite` from: ``$NVPLUG_DEBIAN_MIRROR`` when set, else the
    host's own, from the apt sources under `apt_root` (:func:`pick_debian_mirror`).

    MirrorError when neither gives one: it says what the sources hold and to set the variable.
    """
    override = (os.environ if environ is None else environ).get(MIRROR_ENV, "").strip()
    if override:
        return Mirror(override, f"${MIRROR_ENV}")
    sources = apt_sources(apt_root)
    chosen = pick_debian_mirror(sources, suite)
    if chosen is not None:
        return Mirror(chosen.uri, chosen.where)
    if sources:
        seen = "; ".join(str(s) for s in sources[:6]) + (f"; and {len(sources) - 6} more" if len(sources) > 6 else "")
        why = f"no deb entry is Debian's main archive of {suite} or a later release over http(s) (seen: {seen})"
    else:
        why = f"there are no enabled deb entries in {apt_root / 'sources.list'} or {apt_root / 'sources.list.d'}"
    # Ubuntu's archive has none of Debian's suites; os-release sits beside apt's directory.
    if "ubuntu" in _os_release_ids(apt_root.parent / "os-release"):
        why += f"; this host is Ubuntu-based, and Ubuntu's archive cannot debootstrap Debian {suite}"
    raise MirrorError(
        f"no Debian mirror to debootstrap {suite} from in the apt sources under {apt_root}: {why}. "
        f"Set {MIRROR_ENV} to the URI of a Debian archive mirror that serves {suite}."
    )


def _os_release_ids(path: Path) -> set[str]:
    """ID and ID_LIKE of an os-release file, lower case; empty when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return set()
    ids: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("ID", "ID_LIKE"):
            ids.update(value.strip().strip("\"'").lower().split())
    return ids


# ---------------------------------------------------------------------------
# The cached image
# ---------------------------------------------------------------------------


def _image_complete(root: Path) -> bool:
    return all((root / marker).exists() for marker in _IMAGE_MARKERS) and not (root / "debootstrap").exists()


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One builder or cleaner at a time per cache (other test runs wait)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_image(cache: Path | None = None, *, mirror: str | None = None, log: Log = _stderr) -> Path:
    """The pristine root ``<cache>/bookworm``, made by debootstrap the first time.

    It is built in ``<cache>/bookworm.tmp`` and renamed into place only when
    complete; a complete ``bookworm.tmp`` left by an earlier run is adopted.
    Snapshots left by runs that were killed are removed here too. debootstrap
    downloads from `mirror` if given, else from :func:`debian_mirror`'s
    (``$NVPLUG_DEBIAN_MIRROR``, else the host's apt sources).
    """
    cache = cache or cache_dir()
    image = cache / SUITE
    with _locked(cache):
        _remove_stale_runs(cache, log)
        if _image_complete(image):
            return image
        tmp = cache / f"{SUITE}.tmp"
        if not _image_complete(tmp):
            if shutil.which("debootstrap") is None:
                raise ContainerError("no cached image and no debootstrap (apt-get install debootstrap)")
            source = Mirror(mirror, "the mirror argument") if mirror else debian_mirror()
            shutil.rmtree(tmp, ignore_errors=True)
            argv = [
                "debootstrap", "--variant=minbase", "--include=" + ",".join(IMAGE_PACKAGES),
                SUITE, str(tmp), source.uri,
            ]  # fmt: skip
            log(f"nspawn: building the {SUITE} image from {source.uri} ({source.origin}): {shlex.join(argv)}")
            started = time.monotonic()
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not _image_complete(tmp):
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
                raise ContainerError(
                    f"debootstrap failed (exit {proc.returncode}) with the mirror {source.uri} ({source.origin}); "
                    f"{MIRROR_ENV} chooses another:\n{tail}"
                )
            log(f"nspawn: debootstrap took {time.monotonic() - started:.0f} s")
        else:
            log(f"nspawn: adopting the complete image in {tmp}")
        # Smaller snapshots: the downloaded debs are not needed any more.
        for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        if image.exists():  # an incomplete one
            shutil.rmtree(image)
        tmp.rename(image)
        return image


def _remove_stale_runs(cache: Path, log: Log) -> None:
    """Snapshots whose owner (the nspawn process recorded in them) is gone."""
    for run in cache.glob(_RUN_PREFIX + "*"):
        try:
            pid = int((run / "pid").read_text())
        except (OSError, ValueError):
            pid = 0
        # The pid runs setpriv, unshare and sh, each exec'ing the next, then systemd-nspawn.
        if pid and any(_alive(pid, comm) for comm in ("systemd-nspawn", "setpriv", "unshare", "sh")):
            continue
        if pid == 0 and time.time() - run.stat().st_mtime < 3600:
            continue  # being set up right now by another run
        if _mounts_under(run):
            log(f"nspawn: {run} still has mounts; leaving it")
            continue
        log(f"nspawn: removing the stale snapshot {run}")
        shutil.rmtree(run, ignore_errors=True)
        _remove_cgroups(run.name.removeprefix(_RUN_PREFIX))


def _alive(pid: int, comm: str) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == comm
    except OSError:
        return False


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


# ---------------------------------------------------------------------------
# The container
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bind:
    """A host directory (or file) mounted into the container with ``--bind``/``--bind-ro``.

    Unix sockets work across it in both directions.
    """

    host: Path
    container: str
    read_only: bool = False

    def option(self) -> str:
        flag = "--bind-ro" if self.read_only else "--bind"
        return f"{flag}={self.host}:{self.container}"


Snapshot = Literal["overlay", "copy"]


class Container:
    """A throwaway booted Debian with a real systemd as its PID 1.

    ``with Container(image, binds=[...]) as ctr:`` boots it (``start``) and
    always cleans up (``close``): a poweroff, then SIGKILL for what is left,
    then the snapshot is removed. Commands run inside with ``nsenter`` and a
    clean environment (:data:`CONTAINER_ENV`).
    """

    def __init__(
        self,
        image: Path,
        *,
        binds: Sequence[Bind] = (),
        name: str | None = None,
        snapshot: Snapshot | None = None,
        log: Log = _stderr,
    ) -> None:
        self.image = image
        self.binds = tuple(binds)
        # Machine names become the hostname: short, lowercase, unique per run.
        self.name = name or f"nvplug-{secrets.token_hex(4)}"
        self.snapshot: Snapshot = snapshot or ("overlay" if _overlay_works(image.parent) else "copy")
        self._log = log
        self.run_dir = image.parent / f"{_RUN_PREFIX}{self.name}"
        self.console_log = self.run_dir / "console.log"
        self._nspawn: subprocess.Popen[bytes] | None = None
        self._leader: int | None = None
        # Seconds each phase took: snapshot, boot, poweroff, ...
        self.timings: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> None:
        """Snapshot the image, boot it and wait until ``systemctl is-system-running``
        answers running or degraded."""
        if self._nspawn is not None:
            raise ContainerError("already started")
        try:
            self._boot(timeout)
        except BaseException:
            self.close()
            raise

    def _boot(self, timeout: float) -> None:
        started = time.monotonic()
        self.run_dir.mkdir(parents=True)
        root = self.run_dir / "root"
        argv = [
            "systemd-nspawn", "--quiet", "--boot", "--console=pipe", "--register=no", "--keep-unit",
            # A network namespace of its own: the nvplug inside hears no uevent of the machine's (nor
            # of another test's), and a real nvplug on the machine hears none of the container's.
            "--private-network",
            f"--machine={self.name}", f"--directory={root}", *(b.option() for b in self.binds),
        ]  # fmt: skip
        # The shell moves itself into cgroups of the container's own, then execs nspawn.
        script = "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))} && " for d in self._make_cgroups())
        if self.snapshot == "overlay":
            upper, work = self.run_dir / "upper", self.run_dir / "work"
            for d in (upper, work, root):
                d.mkdir()
            options = f"lowerdir={self.image},upperdir={upper},workdir={work}"
            # The overlay exists only in the new mount namespace that nspawn then runs in.
            script += f"mount -t overlay nvplug-snapshot -o {shlex.quote(options)} {shlex.quote(str(root))} && "
            command = ["unshare", "--mount", "--propagation", "private"]
        else:
            subprocess.run(["cp", "-a", "--reflink=auto", str(self.image), str(root)], check=True)
            command = []
        command += ["sh", "-c", script + "exec " + shlex.join(argv)]
        # If this process dies without closing, nspawn gets SIGTERM and powers the container off;
        # the next ensure_image() removes the snapshot.
        command = ["setpriv", "--pdeathsig", "TERM", "--", *command]
        self.timings["snapshot"] = time.monotonic() - started

        started = time.monotonic()
        with self.console_log.open("wb") as console:
            # A session of its own (setsid): the terminal's signals never reach it.
            self._nspawn = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
            )
        (self.run_dir / "pid").write_text(str(self._nspawn.pid))
        self._leader = self._find_leader(started + timeout)
        state = ""

        def up() -> bool:
            nonlocal state
            if self._nspawn is not None and self._nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited with {self._nspawn.returncode}\n{self.console_tail()}")
            state = self.run("systemctl", "is-system-running", check=False, timeout=10).stdout.strip()
            return state in ("running", "degraded")

        wait_until(
            up,
            max(started + timeout - time.monotonic(), 1.0),
            "systemd in the container to finish booting",
            lambda: f"is-system-running: {state!r}\n{self.console_tail()}",
        )
        self.timings["boot"] = time.monotonic() - started
        self._log(f"nspawn: {self.name} is {state} (leader pid {self._leader}, {self.snapshot} snapshot)")

    def _find_leader(self, deadline: float) -> int:
        """The container's PID 1, seen from the host: the descendant of nspawn that runs
        in another pid namespace and has exec'd systemd."""
        assert self._nspawn is not None
        own_ns = Path("/proc/self/ns/pid").readlink()
        while time.monotonic() < deadline:
            if self._nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited with {self._nspawn.returncode}\n{self.console_tail()}")
            for pid in _descendants(self._nspawn.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/ns/pid").readlink() != own_ns and _alive(pid, "systemd"):
                        return pid
            time.sleep(0.02)
        raise ContainerError(f"no container init under systemd-nspawn ({self._nspawn.pid})\n{self.console_tail()}")

    def close(self, timeout: float = 20.0) -> None:
        """Power off (SIGTERM to nspawn asks systemd to halt), SIGKILL what is left, remove the snapshot."""
        started = time.monotonic()
        proc, leader = self._nspawn, self._leader
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._log(f"nspawn: {self.name} did not power off in {timeout:.0f} s; killing it")
        # Killing the container's PID 1 kills every process in its pid namespace.
        if leader is not None and _alive(leader, "systemd"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(leader, signal.SIGKILL)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self._nspawn = None
        self._leader = None
        self._remove_run_dir()
        self.timings["poweroff"] = time.monotonic() - started

    def _make_cgroups(self) -> list[Path]:
        """A fresh cgroup beside this process's own in each hierarchy that nspawn uses.

        With --keep-unit and --register=no, nspawn runs the container in the cgroup it starts
        in. Two containers started from one cgroup (two suites at once) would share it: each
        one's systemd would find the other's processes in its units' cgroups, see them as pid
        0, and fail every kill of a unit with an I/O error."""
        made: list[Path] = []
        for parent in _nspawn_cgroup_parents():
            own = parent / f"{_CGROUP_PREFIX}{self.name}"
            try:
                own.mkdir()
            except OSError as err:
                self._log(f"nspawn: no cgroup of its own for {self.name} ({own}: {err}); sharing this one")
                continue
            made.append(own)
        return made

    def _remove_run_dir(self) -> None:
        _remove_cgroups(self.name)
        if not self.run_dir.exists():
            return
        mounts = _mounts_under(self.run_dir)
        if mounts:
            # Never delete through a mount: it could be a bound host directory.
            raise ContainerError(f"{self.run_dir} still has mounts, not removing it: {mounts}")
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Container:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def leader(self) -> int:
        if self._leader is None:
            raise ContainerError("the container is not running")
        return self._leader

    @property
    def running(self) -> bool:
        return self._nspawn is not None and self._nspawn.poll() is None

    def console_tail(self, lines: int = 40) -> str:
        try:
            text = self.console_log.read_text(errors="replace")
        except OSError:
            return "(no console output)"
        return "--- container console (tail) ---\n" + "\n".join(text.splitlines()[-lines:])

    # -- commands inside --------------------------------------------------------

    def command(self, *argv: str) -> list[str]:
        """The host argv that runs `argv` inside the container."""
        env = [f"{k}={v}" for k, v in CONTAINER_ENV.items()]
        return ["nsenter", f"--target={self.leader}", "--all", "env", "-i", *env, *argv]

    def run(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = 120.0,
        input: str | None = None,
        stdin: IO[bytes] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside; raise ContainerError with its output when `check` and it fails."""
        try:
            if stdin is not None:
                raw = subprocess.run(
                    self.command(*argv), stdin=stdin, capture_output=True, timeout=timeout, check=False
                )
                proc = subprocess.CompletedProcess(
                    raw.args, raw.returncode, raw.stdout.decode(errors="replace"), raw.stderr.decode(errors="replace")
                )
            else:
                proc = subprocess.run(
                    self.command(*argv),
                    input=input,
                    stdin=None if input is not None else subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    errors="replace",
                    timeout=timeout,
                    check=False,
                )
        except subprocess.TimeoutExpired as err:
            raise ContainerError(f"{shlex.join(argv)} did not finish in {timeout:.0f} s inside {self.name}") from err
        if check and proc.returncode != 0:
            raise ContainerError(
                f"{shlex.join(argv)} failed inside {self.name} (exit {proc.returncode}):\n"
                f"{proc.stdout.rstrip()}\n{proc.stderr.rstrip()}".rstrip()
            )
        return proc

    def sh(self, script: str, *, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return self.run("sh", "-ec", script, check=check, timeout=timeout)

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        """Create or replace `path` (absolute, inside) with `text`, making its directory."""
        self.run(
            "sh", "-ec", 'mkdir -p "$(dirname "$1")"; cat > "$1.new"; chmod "$2" "$1.new"; mv -f "$1.new" "$1"',
            "sh", path, f"{mode:o}", input=text,
        )  # fmt: skip

    def copy_in(self, host: Path, path: str, mode: int = 0o644) -> None:
        """Copy a host file to `path` inside (through a pipe: no bind needed)."""
        with host.open("rb") as src:
            self.run(
                "sh", "-ec", 'mkdir -p "$(dirname "$1")"; cat > "$1"; chmod "$2" "$1"',
                "sh", path, f"{mode:o}", stdin=src,
            )  # fmt: skip

    def exists(self, path: str) -> bool:
        return self.run("test", "-e", path, check=False).returncode == 0

    # -- systemd ------------------------------------------------------------------

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        args = [f"--property={p}" for p in properties]
        out = self.run("systemctl", "show", *args, unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, *options: str) -> str:
        """``journalctl -u unit --no-pager`` plus `options` (``-p err``, ``-o cat``...).

        Flushed first, so entries that systemd already has are all in it."""
        self.run("journalctl", "--sync", check=False)
        return self.run("journalctl", "--no-pager", "--quiet", "-u", unit, *options).stdout

    def wait_journal(self, unit: str, text: str, *options: str, timeout: float = 15.0) -> str:
        """Wait until `text` is in the unit's journal (with `options`); return the journal."""
        seen = ""

        def found() -> bool:
            nonlocal seen
            seen = self.journal(unit, *options)
            return text in seen

        wait_until(found, timeout, f"{text!r} in journalctl -u {unit} {' '.join(options)}", lambda: seen[-4000:])
        return seen


def _nspawn_cgroup_parents() -> list[Path]:
    """This process's cgroup directory in the name=systemd hierarchy (v1 or hybrid) and in
    the unified one (hybrid or v2): the hierarchies nspawn puts the container in."""
    parents: list[Path] = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if controllers == "name=systemd":
            mount = _CGROUP_FS / "systemd"
        elif number == "0" and not controllers:
            mount = _CGROUP_FS / "unified"
            if not (mount / "cgroup.procs").exists():
                mount = _CGROUP_FS
        else:
            continue
        where = mount / path.lstrip("/")
        if (where / "cgroup.procs").exists():
            parents.append(where)
    return parents


def _remove_cgroups(name: str) -> None:
    """The container's cgroups once its processes are gone, deepest first (rmdir is the only
    way to remove a cgroup, and it refuses one that has children or processes)."""
    owns = [parent / f"{_CGROUP_PREFIX}{name}" for parent in _nspawn_cgroup_parents()]
    # Killed processes leave their cgroup a moment after the kill.
    deadline = time.monotonic() + 10.0
    while True:
        for own in (o for o in owns if o.is_dir()):
            for sub in sorted((p for p in own.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                own.rmdir()
        if not any(o.is_dir() for o in owns) or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                queue += children
    return found


def _overlay_works(where: Path) -> bool:
    """Whether an overlay with its upper layer in `where` can be mounted (not on overlayfs, say)."""
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".overlay-probe-", dir=where) as tmp:
        lower, upper, work, merged = (Path(tmp) / d for d in ("lower", "upper", "work", "merged"))
        for d in (lower, upper, work, merged):
            d.mkdir()
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "-t", "overlay", "probe", "-o", options,
             str(merged)],
            capture_output=True,
            check=False,
        )  # fmt: skip
        return probe.returncode == 0


# ---------------------------------------------------------------------------
# The fake NVML, driven from the host
# ---------------------------------------------------------------------------


def service_dropin(
    *,
    environment: Mapping[str, str] = {},
    read_write_paths: Sequence[str] = (),
    watchdog_sec: float | None = None,
    unlimited_starts: bool = False,
) -> str:
    """A drop-in: extra environment, writable paths, a watchdog timeout; with `unlimited_starts`, no
    start rate limit (systemd's default refuses a sixth start within 10 s)."""
    lines = ["[Unit]", "StartLimitIntervalSec=0"] if unlimited_starts else []
    lines.append("[Service]")
    if environment:
        lines.append("Environment=" + " ".join(shlex.quote(f"{k}={v}") for k, v in environment.items()))
    if read_write_paths:
        lines.append("ReadWritePaths=" + " ".join(read_write_paths))
    if watchdog_sec is not None:
        lines.append(f"WatchdogSec={watchdog_sec:g}s")
    return "\n".join(lines) + "\n"
