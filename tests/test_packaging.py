"""The deb and RPM packages: what they hold, how they declare it, and an offline
install of the wheels they ship with the script their install scriptlets run.

Both packages are built once per session (about 15 s with a warm wheel cache,
build/wheel-cache) into a temporary directory, not into dist/. Building needs
dpkg-deb (dpkg) and rpmbuild (Debian's `rpm` package); the install check needs a
CPython 3.11 with the venv module.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nvplug import __version__, config

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
SHIPPED_CONFIG = PACKAGING / "config.yaml"
NPD_CONFIG = PACKAGING / "npd" / "nvplug-gpu-health.json"
NPD_INSTALLED = "/usr/share/nvplug/npd/nvplug-gpu-health.json"
UNCOMMENT_MARK = "# From here on, removing the first `#` of every line gives a valid file."

WHEELS = "/opt/nvplug/wheels"
# Files (not directories) both packages hold, apart from the wheels and the unit.
COMMON_FILES = {
    "/opt/nvplug/setup-venv",
    "/etc/nvplug/config.yaml",
    "/usr/bin/nvplug",
    "/usr/share/doc/nvplug/README.md",
    "/usr/share/nvplug/npd/nvplug-gpu-health.json",
    "/usr/share/nvplug/systemd/nvplug-dra.conf",
    "/usr/share/nvplug/kubernetes/nvplug-node-identity.yaml",
    "/usr/share/nvplug/systemd/nvplug-metrics.conf",
    "/usr/share/nvplug/grafana/nvplug-gpus.json",
    "/usr/lib/tmpfiles.d/nvplug.conf",
}
DEB_UNIT = "/lib/systemd/system/nvplug.service"
RPM_UNIT = "/usr/lib/systemd/system/nvplug.service"
# The companion unit that mounts the MPS clients' shm where containers see it.
DEB_MPS_UNIT = "/lib/systemd/system/nvplug-mps.service"
RPM_MPS_UNIT = "/usr/lib/systemd/system/nvplug-mps.service"


# pyproject.toml's version and dependencies, read without tomllib (Python 3.10 has none).
PYPROJECT = (ROOT / "pyproject.toml").read_text()
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.MULTILINE).group(1)  # type: ignore[union-attr]
DEPENDENCIES = re.findall(r'^\s+"([^"]+)",', PYPROJECT.split("\ndependencies = [", 1)[1].split("\n]", 1)[0], re.M)


def _pins() -> dict[str, str]:
    """packaging/requirements.txt as {canonical name: pinned version}."""
    text = (PACKAGING / "requirements.txt").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert "--hash=sha256:" in line, f"unhashed pin: {line}"
        req = Requirement(line.split("--hash", 1)[0].strip())
        (spec,) = req.specifier
        assert spec.operator == "==", f"not an exact pin: {line}"
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def _expected_wheels(paths: set[str]) -> None:
    """The wheels in `paths` are exactly nvplug's and one per pin, at the pinned versions."""
    wheels = {p.rsplit("/", 1)[1] for p in paths if p.startswith(WHEELS + "/")}
    found = {}
    for name in wheels:
        assert name.endswith(".whl"), name
        project, version = name.split("-")[:2]
        found[canonicalize_name(project)] = version
    expected = {**_pins(), "nvplug": VERSION}
    assert found == expected
    assert len(wheels) == len(expected)


def _run(*cmd: str | Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    args = [str(c) for c in cmd]
    proc = subprocess.run(args, capture_output=True, text=True, check=False, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@dataclass(frozen=True)
class Built:
    deb: Path
    rpm: Path


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    missing = [tool for tool in ("dpkg-deb", "rpmbuild", "rpm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: `apt-get install dpkg rpm` builds the packages")
    work = tmp_path_factory.mktemp("packages")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "NVPLUG_BUILD_DIR": str(work / "build"),
        "NVPLUG_DIST_DIR": str(work / "dist"),
    }
    paths = []
    for script in ("build-deb.sh", "build-rpm.sh"):
        out = _run("bash", PACKAGING / script, env=env, timeout=600)
        path = Path(out.strip().splitlines()[-1])
        assert path.parent == work / "dist" and path.is_file(), out
        paths.append(path)
    yield Built(*paths)


def test_package_names_follow_pyproject(built: Built) -> None:
    assert built.deb.name == f"nvplug_{VERSION}-1_amd64.deb"
    assert built.rpm.name == f"nvplug-{VERSION}-1.x86_64.rpm"


def test_package_sizes(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        for path in (built.deb, built.rpm):
            print(f"\n{path.name}: {path.stat().st_size:,} bytes ({path.stat().st_size / 2**20:.1f} MiB)", end="")
        print()
    # Wheels dominate: grpcio's alone is ~7 MiB. Catch an accidental venv or cache in the payload.
    assert built.deb.stat().st_size < 20 * 2**20
    assert built.rpm.stat().st_size < 20 * 2**20


# --- the deb ---


def _deb_entries(deb: Path) -> dict[str, str]:
    """{absolute path: `dpkg-deb -c` line} for every entry."""
    entries = {}
    for line in _run("dpkg-deb", "-c", deb).splitlines():
        # drwxr-xr-x root/root 0 2024-01-01 00:00 ./etc/  ->  /etc
        path = line.split(None, 5)[5].split(" -> ")[0]
        entries["/" + path.removeprefix("./").rstrip("/")] = line
    return entries


def test_deb_holds_the_layout(built: Built) -> None:
    entries = _deb_entries(built.deb)
    files = {path for path, line in entries.items() if not line.startswith("d")}
    _expected_wheels(files)
    assert files - {p for p in files if p.startswith(WHEELS + "/")} == COMMON_FILES | {DEB_UNIT, DEB_MPS_UNIT}
    assert all(" root/root " in line for line in entries.values())
    assert entries["/usr/bin/nvplug"].startswith("l")
    assert entries["/usr/bin/nvplug"].endswith(" -> /opt/nvplug/venv/bin/nvplug")
    assert entries["/opt/nvplug/setup-venv"].startswith("-rwxr-xr-x")
    # Built at install time, never shipped; the kubelet owns its directory.
    assert not any(p.startswith(("/opt/nvplug/venv", "/var/lib/kubelet")) for p in entries)


def test_deb_control_declares_depends_and_conffile(built: Built) -> None:
    info = _run("dpkg-deb", "-I", built.deb)
    fields = dict(re.findall(r"^ (\w[\w-]*): (.*)$", info, re.MULTILINE))
    assert fields["Package"] == "nvplug"
    assert fields["Version"] == f"{VERSION}-1"
    assert fields["Architecture"] == "amd64"
    depends = {d.strip() for d in fields["Depends"].split(",")}
    assert {"python3.11", "python3.11-venv", "libudev1"} <= depends
    assert _run("dpkg-deb", "-I", built.deb, "conffiles").split() == ["/etc/nvplug/config.yaml"]
    for script in ("postinst", "prerm", "postrm"):
        assert re.search(rf"^\s+\d+ bytes,\s+\d+ lines\s+\*\s+{script}\s+#!/bin/sh$", info, re.MULTILINE), script


def test_deb_scripts_build_the_venv_and_drive_the_unit(built: Built, tmp_path: Path) -> None:
    _run("dpkg-deb", "-e", built.deb, tmp_path)
    postinst = (tmp_path / "postinst").read_text()
    prerm = (tmp_path / "prerm").read_text()
    postrm = (tmp_path / "postrm").read_text()
    for text in (postinst, prerm, postrm):
        _run("sh", "-n", "-c", text)
    assert "/opt/nvplug/setup-venv" in postinst
    assert "mkdir -p /var/lib/kubelet/device-plugins" in postinst
    assert 'systemctl enable --now "$UNIT"' in postinst
    assert 'systemctl try-restart "$UNIT"' in postinst
    assert 'systemctl disable --now "$UNIT"' in prerm
    assert "rm -rf /opt/nvplug/venv" in prerm
    assert "systemctl daemon-reload" in postrm
    # systemd only when it runs: chroots and image builds must not fail.
    assert "[ -d /run/systemd/system ]" in postinst and "[ -d /run/systemd/system ]" in prerm


# --- the RPM ---


def test_rpm_holds_the_layout(built: Built) -> None:
    listed = _run("rpm", "-qlp", built.rpm).split()
    flags = dict(
        line.split(" ", 1)
        for line in _run("rpm", "-qp", "--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]", built.rpm).splitlines()
    )
    dirs = {"/opt/nvplug", WHEELS, "/etc/nvplug", "/usr/share/doc/nvplug", "/usr/share/nvplug", "/usr/share/nvplug/npd",
            "/usr/share/nvplug/systemd", "/usr/share/nvplug/kubernetes", "/usr/share/nvplug/grafana"}  # fmt: skip
    files = set(listed) - dirs
    _expected_wheels(files)
    assert files - {p for p in files if p.startswith(WHEELS + "/")} == COMMON_FILES | {RPM_UNIT, RPM_MPS_UNIT}
    assert dirs <= set(listed)
    assert _run("rpm", "-qcp", built.rpm).split() == ["/etc/nvplug/config.yaml"]
    assert flags["/etc/nvplug/config.yaml"] == "cn"  # config, noreplace
    assert flags["/usr/share/doc/nvplug/README.md"] == "d"
    assert flags[NPD_INSTALLED] == ""  # not a conffile: NPD reads it where it is, or a copy


def test_rpm_requires_and_scriptlets(built: Built) -> None:
    requires = set(_run("rpm", "-qp", "--requires", built.rpm).split("\n"))
    assert {"python3.11", "systemd-libs"} <= requires
    assert _run("rpm", "-qp", "--qf", "%{ARCH} %{VERSION}-%{RELEASE}", built.rpm) == f"x86_64 {VERSION}-1"
    scripts = _run("rpm", "-qp", "--scripts", built.rpm)
    scriptlet = r"^(\w+) scriptlet \(using /bin/sh\):\n(.*?)(?=^\w+ scriptlet|\Z)"
    sections = dict(re.findall(scriptlet, scripts, re.M | re.S))
    assert set(sections) == {"preuninstall", "postuninstall", "posttrans"}
    for text in sections.values():
        _run("sh", "-n", "-c", text)
    assert "/opt/nvplug/setup-venv" in sections["posttrans"]
    assert "systemctl enable --now nvplug.service" in sections["posttrans"]
    assert "systemctl try-restart nvplug.service" in sections["posttrans"]
    assert "systemctl disable --now nvplug.service" in sections["preuninstall"]


def test_rpm_and_deb_ship_the_same_wheels(built: Built) -> None:
    rpm_wheels = {p for p in _run("rpm", "-qlp", built.rpm).split() if p.endswith(".whl")}
    deb_wheels = {p for p in _deb_entries(built.deb) if p.endswith(".whl")}
    assert rpm_wheels == deb_wheels


# --- installing the wheels offline, as the scriptlets do ---


def _python311() -> str | None:
    """A CPython 3.11 that can make venvs with pip: Debian's (what the deb uses) first."""
    for candidate in ("/usr/bin/python3.11", shutil.which("python3.11")):
        if candidate and Path(candidate).exists():
            probe = subprocess.run(
                [candidate, "-c", "import sys, ensurepip, venv; assert sys.version_info[:2] == (3, 11)"],
                capture_output=True,
                check=False,
            )
            if probe.returncode == 0:
                return candidate
    return None


def test_wheels_install_offline_into_a_fresh_venv(built: Built, tmp_path: Path) -> None:
    python = _python311()
    if python is None:
        pytest.skip("no CPython 3.11 with ensurepip (Debian: apt-get install python3.11-venv)")
    _run("dpkg-deb", "-x", built.deb, tmp_path)
    prefix = tmp_path / "opt" / "nvplug"
    # The very script postinst and %posttrans run, with the venv under tmp_path. It
    # clears the environment and passes --no-index itself: nothing comes from the network.
    _run(prefix / "setup-venv", prefix, python, timeout=300)
    venv = prefix / "venv"
    assert _run(venv / "bin" / "nvplug", "--version").strip() == f"nvplug {__version__}"
    _run(venv / "bin" / "python", "-m", "pip", "check")
    # Only the shipped wheels are in it, at their pinned versions.
    pip = (venv / "bin" / "python", "-m", "pip")
    listed = _run(*pip, "list", "--format=freeze", "--exclude", "pip", "--exclude", "setuptools")
    installed = {canonicalize_name(n): v for n, v in (line.split("==") for line in listed.split())}
    assert installed == {**_pins(), "nvplug": VERSION}


# --- the shipped config and the pins ---


def test_shipped_config_loads_as_the_defaults() -> None:
    loaded = config.load(SHIPPED_CONFIG)
    assert loaded.health == config.HealthConfig()
    assert loaded.source == str(SHIPPED_CONFIG)


def test_shipped_config_examples_are_valid_and_show_the_defaults() -> None:
    lines = SHIPPED_CONFIG.read_text().splitlines()
    at = lines.index(UNCOMMENT_MARK) + 1
    for line in lines[at:]:
        assert not line or line.startswith("#"), f"not commented out: {line!r}"
    text = "\n".join(lines[:at] + [line[1:] for line in lines[at:]])
    assert config.parse(text, "uncommented").health == config.HealthConfig()
    data = yaml.safe_load(text)
    assert set(data) == set(config.SECTIONS)
    assert data["flags"]["plugin"].keys() >= {"passDeviceSpecs", "deviceListStrategy", "deviceIDStrategy"}
    assert data["flags"].keys() >= {"migStrategy", "failOnInitError"}
    assert "timeSlicing" in data["sharing"]
    assert data["nvplug"]["cdi"] == {"specDir": config.DEFAULT_CDI_SPEC_DIR}
    assert data["nvplug"]["podResources"] == {"socket": config.DEFAULT_POD_RESOURCES_SOCKET}
    assert data["nvplug"]["labels"] == {"featureFile": config.DEFAULT_FEATURE_FILE, "unhealthyCount": False}
    assert data["nvplug"]["health"].keys() == {
        "ignoreXids",
        "fatalXids",
        "reprobeInitialSeconds",
        "reprobeMaxSeconds",
    }


def test_packages_ship_the_config_from_the_tree(built: Built, tmp_path: Path) -> None:
    _run("dpkg-deb", "-x", built.deb, tmp_path)
    assert (tmp_path / "etc/nvplug/config.yaml").read_bytes() == SHIPPED_CONFIG.read_bytes()
    for name in ("nvplug.service", "nvplug-mps.service"):
        unit = (ROOT / "systemd" / name).read_bytes()
        assert (tmp_path / "lib" / "systemd" / "system" / name).read_bytes() == unit
    assert (tmp_path / NPD_INSTALLED.lstrip("/")).read_bytes() == NPD_CONFIG.read_bytes()
    # The RPM takes it from the tree, not from the stage: the same bytes, by digest.
    digests = dict(
        line.split(" ", 1)
        for line in _run("rpm", "-qp", "--qf", "[%{FILENAMES} %{FILEDIGESTS}\n]", built.rpm).splitlines()
    )
    assert digests[NPD_INSTALLED] == hashlib.sha256(NPD_CONFIG.read_bytes()).hexdigest()


def test_pins_satisfy_pyproject() -> None:
    pins = _pins()
    assert len(DEPENDENCIES) >= 6, DEPENDENCIES
    # Nothing shipped that nothing needs (grpcio needs typing-extensions).
    direct = {canonicalize_name(Requirement(d).name) for d in DEPENDENCIES}
    assert set(pins) - direct <= {"typing-extensions"}, sorted(set(pins) - direct)
    for req in map(Requirement, DEPENDENCIES):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in packaging/requirements.txt"
        assert req.specifier.contains(pins[name]), f"{req.name}=={pins[name]} is outside pyproject's {req}"
    # The generated gRPC code's floor, whatever pyproject says.
    assert tuple(int(p) for p in pins["grpcio"].split(".")[:3]) >= (1, 85, 1)
    protobuf = tuple(int(p) for p in pins["protobuf"].split(".")[:3])
    assert (7, 35, 1) <= protobuf < (8,)
