"""The CDI spec, without a daemon: names, entries, driver files, the writer, conflicts, the publisher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nvplug import config
from nvplug.cdi.cdi_spec import (
    ALL,
    CDI_VERSION,
    GPU_KIND,
    DriverFiles,
    Roots,
    device_name,
    gpu_spec,
    shared_edits,
)
from nvplug.core.events import CdiChecked, InventoryFound
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.health import Health
from nvplug.core.mig import CapMinors
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot
from nvplug.kubelet.allocation import AllocationPolicy, allocate
from nvplug.shaping.resource_plan import ResourceSpec
from nvplug.sinks.cdi import driver_files as driverfiles
from nvplug.sinks.cdi.cdi_files import SpecWriter, conflicts, read_specs
from nvplug.sinks.cdi.cdi_publisher import CdiSettings, SpecPublisher
from nvplug.testing import fake_driver_root as driverroot

MIG = MigDevice("MIG-aaaa", gpu_instance=3, compute_instance=0, profile="1g.10gb")
MIG2 = MigDevice("MIG-bbbb", gpu_instance=5, compute_instance=0, profile="1g.10gb")
GPU0 = Gpu("GPU-0", 0, "0000:18:00.0", minor=0)
GPU1 = Gpu("GPU-1", 1, "0000:2a:00.0", minor=4, mig_enabled=True, mig=(MIG, MIG2))
CAPS = CapMinors({(4, 3): 30, (4, 5): 50}, {(4, 3, 0): 31, (4, 5, 0): 51})
ROOTS = Roots("/run/nvidia/driver", "/run/nvidia/driver")


def snapshot(*gpus: Gpu, version: str = "550.54.15", caps: CapMinors = CAPS) -> Snapshot:
    state = NodeState()
    state.apply(InventoryFound(gpus, cap_minors=caps, driver_version=version))
    return state.current


def test_names_follow_the_id_strategy() -> None:
    assert device_name(GPU1, None, "uuid") == "GPU-1"
    assert device_name(GPU1, MIG2, "uuid") == "MIG-bbbb"
    assert device_name(GPU1, None, "index") == "1"
    assert device_name(GPU1, MIG2, "index") == "1:1"


def test_gpu_spec_entries_for_whole_gpus_and_mig_devices() -> None:
    units = [(GPU0, None), (GPU1, None), (GPU1, MIG), (GPU1, MIG2)]
    spec, skipped = gpu_spec(units, "uuid", CAPS, ROOTS, shared_edits(DriverFiles(), ROOTS, [], None))
    assert skipped == {}
    doc = json.loads(spec.render())
    assert doc["cdiVersion"] == CDI_VERSION and doc["kind"] == GPU_KIND
    entries = {d["name"]: d["containerEdits"]["deviceNodes"] for d in doc["devices"]}
    assert entries["GPU-0"] == [{"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}]
    # A MIG device: its parent's node and the two capability nodes of its instances.
    assert [n["path"] for n in entries["MIG-aaaa"]] == [
        "/dev/nvidia4",
        "/dev/nvidia-caps/nvidia-cap30",
        "/dev/nvidia-caps/nvidia-cap31",
    ]
    assert [n["path"] for n in entries[ALL]] == ["/dev/nvidia0", "/dev/nvidia4"]
    assert spec.file_name == "k8s.device-plugin.nvidia.com-gpu.json"


def test_devices_that_cannot_be_described_are_left_out_with_the_reason() -> None:
    no_minor = Gpu("GPU-9", 9, "0000:99:00.0")
    units = [(no_minor, None), (GPU1, MIG)]
    spec, skipped = gpu_spec(units, "index", CapMinors(), ROOTS, shared_edits(DriverFiles(), ROOTS, [], None))
    assert set(spec.devices) == set()
    assert "minor number" in skipped["GPU-9"] and "capability device minors" in skipped["MIG-aaaa"]


@pytest.fixture(scope="module")
def drv(tmp_path_factory: pytest.TempPathFactory) -> driverroot.FakeDriverRoot:
    return driverroot.build(tmp_path_factory.mktemp("drv"))


def test_driver_files_are_found_through_the_ld_cache(drv: driverroot.FakeDriverRoot) -> None:
    files = driverfiles.discover(drv.root, drv.version)
    lib = f"/{driverroot.LIB_DIR}"
    assert set(files.libraries) == {f"{lib}/{stem}.so.{drv.version}" for stem, _ in driverroot.DRIVER_LIBRARIES}
    # The SONAME links ldconfig made, each to its library; nothing of another version.
    assert files.links[f"{lib}/libcuda.so.1"] == f"{lib}/libcuda.so.{drv.version}"
    assert files.links[f"{lib}/libnvidia-nvvm.so.4"] == f"{lib}/libnvidia-nvvm.so.{drv.version}"
    assert not any("libz-fake" in p for p in [*files.libraries, *files.links])
    assert files.binaries == tuple(f"/usr/bin/{b}" for b in driverroot.BINARIES)
    assert files.firmware == tuple(
        f"/lib/firmware/nvidia/{drv.version}/{f}" for f in ("gsp_ga10x.bin", "gsp_tu10x.bin")
    )
    assert files.sockets == ("/run/nvidia-persistenced/socket",)
    assert files.problems == ()


def test_driver_files_problems_are_said(drv: driverroot.FakeDriverRoot, tmp_path: Path) -> None:
    assert "version is unknown" in driverfiles.discover(drv.root, None).problems[0]
    other = driverfiles.discover(drv.root, "535.1.2")
    assert other.libraries == () and any("lists no library of driver 535.1.2" in p for p in other.problems)
    empty = driverfiles.discover(tmp_path, drv.version)
    assert any("cannot read the ld cache" in p for p in empty.problems)


def test_shared_edits_without_a_hook_mount_the_soname_links(drv: driverroot.FakeDriverRoot) -> None:
    files = driverfiles.discover(drv.root, drv.version)
    roots = Roots(str(drv.root), "/")
    edits = shared_edits(files, roots, ["/dev/nvidiactl"], None)
    mounts = {m.container_path: m.host_path for m in edits.mounts}
    libcuda = f"/{driverroot.LIB_DIR}/libcuda.so.{drv.version}"
    assert mounts[libcuda] == str(drv.library("libcuda"))
    # libcuda.so.1 works without any hook: the library itself, mounted at its SONAME.
    assert mounts[f"/{driverroot.LIB_DIR}/libcuda.so.1"] == str(drv.library("libcuda"))
    assert mounts["/usr/bin/nvidia-smi"] == str(drv.root / "usr/bin/nvidia-smi")
    assert "noexec" in next(m.options for m in edits.mounts if m.container_path.endswith("/socket"))
    assert edits.hooks == () and [n.path for n in edits.nodes] == ["/dev/nvidiactl"]


@pytest.mark.parametrize(
    ("hook", "head"),
    [("/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook",)), ("/usr/bin/nvidia-ctk", ("nvidia-ctk", "hook"))],
)
def test_shared_edits_with_nvidias_hook(drv: driverroot.FakeDriverRoot, hook: str, head: tuple[str, ...]) -> None:
    files = driverfiles.discover(drv.root, drv.version)
    edits = shared_edits(files, Roots(str(drv.root), "/"), [], hook)
    lib = f"/{driverroot.LIB_DIR}"
    args = [h.args for h in edits.hooks]
    assert args == [
        (*head, "create-symlinks", "--link", f"libcuda.so.1::{lib}/libcuda.so"),
        (*head, "update-ldcache", "--folder", lib),
    ]
    assert all(h.path == hook for h in edits.hooks)
    assert f"{lib}/libcuda.so.1" not in {m.container_path for m in edits.mounts}  # the hook makes the links


def test_settings_find_the_hook_beside_nvidia_ctk(tmp_path: Path) -> None:
    ctk = tmp_path / "nvidia-ctk"
    settings = CdiSettings(None, ctk_path=str(ctk))
    assert settings.hook() is None
    ctk.write_text("#!/bin/sh\n")
    ctk.chmod(0o755)
    assert settings.hook() == str(ctk)
    beside = tmp_path / "nvidia-cdi-hook"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert settings.hook() == str(beside)


def test_settings_from_config_read_through_container_driver_root(tmp_path: Path) -> None:
    text = f"""
flags:
  nvidiaDriverRoot: /run/nvidia/driver
  plugin:
    containerDriverRoot: {tmp_path}
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
  gdsEnabled: true
nvplug:
  cdi:
    specDir: /etc/cdi
"""
    s = CdiSettings.from_config(config.parse(text, "t.yaml"))
    assert (s.spec_dir, s.read_root, s.roots.driver, s.roots.dev) == (
        Path("/etc/cdi"),
        tmp_path,
        "/run/nvidia/driver",
        "/run/nvidia/driver",
    )
    assert s.enforce and s.id_strategy == "index" and s.optional == ("gds",)
    assert not CdiSettings.from_config(config.Config()).enforce
    assert CdiSettings.from_config(config.parse("nvplug: {cdi: {specDir: 'off'}}", "t")).spec_dir is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("nvplug: {cdi: {specDir: 'off'}}\nflags: {plugin: {deviceListStrategy: cdi-cri}}", "nothing would define"),
        ("nvplug: {cdi: {specDir: relative/dir}}", "neither off nor an absolute path"),
        ("nvplug: {cdi: {specdir: /x}}", "specdir"),
        ("flags: {plugin: {cdiAnnotationPrefix: 'cdi.k8s.io/" + "x" * 41 + "'}}", "longer than 63"),
        ("flags: {plugin: {cdiAnnotationPrefix: 'no-slash'}}", "followed by '/'"),
    ],
)
def test_cdi_config_errors(text: str, error: str) -> None:
    with pytest.raises(config.ConfigError, match=error):
        config.parse(text, "t.yaml")


def test_annotation_key_fits_the_limit_and_names_include_the_extra_classes() -> None:
    prefix = "cdi.k8s.io/" + "x" * 40  # the longest prefix the config accepts
    config.parse(f"flags: {{plugin: {{cdiAnnotationPrefix: '{prefix}'}}}}", "t.yaml")
    resource = ResourceSpec().project(snapshot(GPU0))
    policy = AllocationPolicy(
        ("cdi-annotations", "cdi-cri"),
        cdi_annotation_prefix=prefix,
        cdi_extra=("k8s.device-plugin.nvidia.com/gds=all",),
    )
    out = allocate(resource, ["GPU-0"], policy, lambda p: p, lambda p: True)
    ((key, value),) = out.annotations.items()
    assert len(key.split("/", 1)[1]) == config.MAX_ANNOTATION_NAME
    assert value == "k8s.device-plugin.nvidia.com/gpu=GPU-0,k8s.device-plugin.nvidia.com/gds=all"
    assert out.cdi_devices == tuple(value.split(","))


def test_writer_is_atomic_0644_and_writes_only_changes(tmp_path: Path) -> None:
    directory = tmp_path / "run/cdi"
    writer = SpecWriter(directory)
    spec, _ = gpu_spec([(GPU0, None)], "uuid", CAPS, ROOTS, shared_edits(DriverFiles(), ROOTS, [], None))
    writer.write([spec])
    path = directory / spec.file_name
    assert json.loads(path.read_text())["kind"] == GPU_KIND
    assert path.stat().st_mode & 0o777 == 0o644 and directory.stat().st_mode & 0o777 == 0o755
    inode = path.stat().st_ino
    writer.write([spec])
    assert path.stat().st_ino == inode  # unchanged content, no new file
    assert [p.name for p in directory.iterdir()] == [spec.file_name]  # no temp file left
    writer.write([])
    assert not path.exists()


def test_writer_error_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    writer = SpecWriter(tmp_path / "file/cdi")
    spec, _ = gpu_spec([(GPU0, None)], "uuid", CAPS, ROOTS, shared_edits(DriverFiles(), ROOTS, [], None))
    with pytest.raises(OSError, match=r"cannot write the CDI spec .*file/cdi/k8s.device-plugin.nvidia.com-gpu.json"):
        writer.write([spec])


def test_foreign_specs_of_our_kind_are_conflicts(tmp_path: Path) -> None:
    ours = tmp_path / "run" / "k8s.device-plugin.nvidia.com-gpu.json"
    ours.parent.mkdir()
    ours.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": GPU_KIND, "devices": [{"name": "GPU-0"}]}))
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "old-plugin.yaml").write_text(f"cdiVersion: 0.5.0\nkind: {GPU_KIND}\ndevices:\n- name: GPU-0\n- name: '1'\n")
    (etc / "toolkit.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: GPU-0\n")
    (etc / "broken.json").write_text("{not json")
    files = read_specs([etc, ours.parent])
    assert [f.path.name for f in files] == ["broken.json", "old-plugin.yaml", "toolkit.yaml", ours.name]
    assert files[0].error is not None and files[1].qualified() == [f"{GPU_KIND}=GPU-0", f"{GPU_KIND}=1"]
    (problem,) = conflicts(files, [ours], [GPU_KIND])
    assert "old-plugin.yaml also defines CDI kind k8s.device-plugin.nvidia.com/gpu" in problem
    assert "1 of the same names (GPU-0)" in problem


def test_publisher_refuses_names_it_could_not_write(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    publisher = SpecPublisher(CdiSettings(tmp_path / "file/cdi", enforce=True))
    unresolved = publisher.update(snapshot(GPU0, GPU1))
    assert set(unresolved) == {"GPU-0", "GPU-1", "MIG-aaaa", "MIG-bbbb"}
    assert "could not be written" in unresolved["GPU-0"] and "Not a directory" in unresolved["GPU-0"]
    assert publisher.error is not None
    # Not enforced (no cdi strategy): the same failure refuses nothing.
    assert SpecPublisher(CdiSettings(tmp_path / "file/cdi")).update(snapshot(GPU0)) == {}


def test_state_takes_unresolved_devices_out_and_back() -> None:
    state = NodeState()
    state.apply(InventoryFound((GPU0,), driver_version="550.54.15"))
    state.apply(CdiChecked({"GPU-0": "no CDI device: disk full"}))
    health = state.current.health["GPU-0"]
    assert health.health is Health.UNHEALTHY and "cannot be allocated: no CDI device" in health.reason
    # A scan that finds every node does not heal what the spec still lacks.
    state.apply(InventoryFound((GPU0,), driver_version="550.54.15"))
    assert not state.current.health["GPU-0"].healthy
    state.apply(CdiChecked({}))
    assert state.current.health["GPU-0"].healthy


def test_publisher_keeps_a_removed_device_until_a_list_without_it_is_delivered(tmp_path: Path) -> None:
    publisher = SpecPublisher(CdiSettings(tmp_path, enforce=True))
    path = tmp_path / "k8s.device-plugin.nvidia.com-gpu.json"
    assert publisher.update(snapshot(GPU0, GPU1)) == {}
    publisher.delivered("nvidia.com/gpu", [(GPU0, None), (GPU1, None)])

    def names() -> set[str]:
        return {d["name"] for d in json.loads(path.read_text())["devices"]}

    publisher.update(snapshot(GPU1))
    assert "GPU-0" in names()  # the kubelet may still allocate it
    publisher.delivered("nvidia.com/gpu", [(GPU1, None)])
    publisher.update(snapshot(GPU1))
    assert "GPU-0" not in names() and "GPU-1" in names()


def test_publisher_writes_optional_classes_whose_nodes_exist(tmp_path: Path) -> None:
    dev = tmp_path / "dev-root"
    (dev / "dev/infiniband").mkdir(parents=True)
    (dev / "dev/nvidia-fs0").touch()
    (dev / "dev/nvidia-fs1").touch()
    (dev / "dev/nvidia-caps-imex-channels").mkdir()
    (dev / "dev/nvidia-caps-imex-channels/channel0").touch()
    settings = CdiSettings(tmp_path / "cdi", roots=Roots("/", str(dev)), optional=("gds", "mofed"), imex_channels=(0,))
    publisher = SpecPublisher(settings)
    publisher.update(snapshot(GPU0))
    assert publisher.extra_names == (
        "k8s.device-plugin.nvidia.com/gds=all",
        "k8s.device-plugin.nvidia.com/imex-channel=0",
    )
    gds = json.loads((tmp_path / "cdi/k8s.device-plugin.nvidia.com-gds.json").read_text())
    assert [n["path"] for n in gds["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia-fs0",
        "/dev/nvidia-fs1",
    ]
    assert not (tmp_path / "cdi/k8s.device-plugin.nvidia.com-mofed.json").exists()  # no uverbs node
    # Turned off by a reload: its spec goes.
    publisher.configure(CdiSettings(tmp_path / "cdi", roots=Roots("/", str(dev))))
    publisher.update(snapshot(GPU0))
    assert not (tmp_path / "cdi/k8s.device-plugin.nvidia.com-gds.json").exists() and publisher.extra_names == ()


def test_a_new_spec_dir_takes_the_spec_with_it(tmp_path: Path) -> None:
    publisher = SpecPublisher(CdiSettings(tmp_path / "a"))
    publisher.update(snapshot(GPU0))
    assert publisher.configure(CdiSettings(tmp_path / "b"))
    publisher.update(snapshot(GPU0))
    assert list((tmp_path / "a").iterdir()) == [] and len(list((tmp_path / "b").iterdir())) == 1
