"""Config loading: NVIDIA's v1 schema with its defaults, nvplug's own section, errors that name
file, key and line, hostile YAML, and the `nvplug config` commands."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nvplug import config
from nvplug.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NVIDIA_V1 = FIXTURES / "nvidia-v1.yaml"
SHIPPED = ROOT / "packaging" / "config.yaml"


def test_missing_default_file_means_built_in_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.yaml")
    assert config.load(None) == config.Config()


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"absent\.yaml: no such config file"):
        config.load(tmp_path / "absent.yaml")


def test_nvidia_v1_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing: {}\n")
    assert config.load(path).source == str(path)


def test_unknown_key_names_file_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\n\nflagz: {}\n")
    with pytest.raises(config.ConfigError, match=r"c\.yaml, line 3: flagz: unknown key"):
        config.load(path)


def test_bad_version_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="line 1: version: 'v2' is not supported"):
        config.parse("version: v2\n", "x")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.parse("a: [\n", "x")
    with pytest.raises(config.ConfigError, match="top level must be a mapping"):
        config.parse("- a\n", "x")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.parse("version: v1\n---\nversion: v1\n", "x")


def test_huge_file_is_refused_unparsed(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (config.MAX_BYTES + 10))
    with pytest.raises(config.ConfigError, match="larger than"):
        config.load(path)
    with pytest.raises(config.ConfigError, match="larger than"):
        config.parse("#" * (config.MAX_BYTES + 10), "text")


# --- NVIDIA's schema ---


def test_defaults_are_nvidias_but_one() -> None:
    cfg = config.Config()
    flags = cfg.flags
    assert (flags.mig_strategy, flags.fail_on_init_error, flags.nvidia_driver_root) == ("none", True, "/")
    assert (flags.gds_enabled, flags.mofed_enabled, flags.device_discovery_strategy) == (False, False, "auto")
    plugin = flags.plugin
    # The one deliberate difference: a host service hands out the device nodes itself.
    assert (plugin.pass_device_specs, plugin.device_list_strategy, plugin.device_id_strategy) == (
        True,
        ("envvar",),
        "uuid",
    )
    assert (plugin.cdi_annotation_prefix, plugin.nvidia_ctk_path, plugin.container_driver_root) == (
        "cdi.k8s.io/",
        "/usr/bin/nvidia-ctk",
        "/driver-root",
    )
    assert cfg.resources.gpus == (config.ResourcePattern("*", "nvidia.com/gpu"),)
    assert cfg.sharing.strategy == "none"
    assert cfg.imex == config.Imex((), False)
    # An empty file and empty sections mean the same.
    assert config.parse("", "x") == dataclasses.replace(cfg, source="x")
    empty_sections = "version: v1\nflags:\n  plugin:\nresources:\nsharing:\n  timeSlicing:\n  mps:\nimex:\nnvplug:\n"
    assert config.parse(empty_sections, "x") == dataclasses.replace(cfg, source="x")


def test_nvidia_file_from_their_docs_loads_unchanged() -> None:
    cfg = config.load(NVIDIA_V1)
    flags = cfg.flags
    assert flags.mig_strategy == "mixed"
    assert flags.fail_on_init_error is True
    assert flags.nvidia_driver_root == "/run/nvidia/driver"
    assert flags.nvidia_dev_root == "/run/nvidia/driver"  # follows the driver root, as NVIDIA's does
    assert flags.device_discovery_strategy == "nvml"
    assert flags.plugin == config.PluginFlags(
        pass_device_specs=True,
        device_list_strategy=("envvar", "cdi-annotations"),
        device_id_strategy="index",
        cdi_annotation_prefix="nvidia.cdi.k8s.io/",
        nvidia_ctk_path="/usr/local/nvidia/toolkit/nvidia-ctk",
        container_driver_root="/driver-root",
    )
    assert cfg.resources.gpus == (config.ResourcePattern("*", "nvidia.com/gpu"),)
    # NVIDIA's short form: a name without a domain is in nvidia.com.
    assert cfg.resources.mig == (
        config.ResourcePattern("1g.10gb", "nvidia.com/mig-1g.10gb"),
        config.ResourcePattern("3g.40gb", "nvidia.com/mig-3g.40gb"),
    )
    ts = cfg.sharing.time_slicing
    assert (ts.rename_by_default, ts.fail_requests_greater_than_one) == (True, True)
    assert ts.resources == (
        config.ReplicatedResource("nvidia.com/gpu", 10, "nvidia.com/gpu.shared", "all"),
        # An unquoted 1:0 is base 60 to PyYAML but a MIG index to NVIDIA: read as NVIDIA does.
        config.ReplicatedResource("nvidia.com/mig-1g.10gb", 2, "nvidia.com/mig-1g.10gb.tiny", ("0:0", "0:1", "1:0")),
        config.ReplicatedResource("nvidia.com/mig-3g.40gb", 3, "nvidia.com/mig-3g.40gb.shared", 2),
    )
    assert ts.resources[0].advertised_name == "nvidia.com/gpu.shared"
    assert cfg.sharing.strategy == "time-slicing"
    assert cfg.sharing.replicated is ts
    assert cfg.imex == config.Imex((0,), False)
    assert cfg.health == config.HealthConfig()


def test_mps_and_device_lists() -> None:
    text = """
version: v1
flags:
  mpsRoot: /run/nvidia/mps
sharing:
  mps:
    renameByDefault: false
    resources:
    - name: gpu
      replicas: 4
      devices: [0, "2", GPU-b1028956-cfa2-0990-bf4a-5da9abb51763, MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0]
"""
    cfg = config.parse(text, "c.yaml")
    assert cfg.flags.mps_root == "/run/nvidia/mps"
    assert cfg.sharing.strategy == "mps"
    (resource,) = cfg.sharing.replicated.resources
    assert resource.name == resource.advertised_name == "nvidia.com/gpu"
    assert resource.devices == (
        "0",
        "2",
        "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763",
        "MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0",
    )


def test_device_list_strategy_may_be_one_string() -> None:
    cfg = config.parse("flags:\n  plugin:\n    deviceListStrategy: cdi-cri\n", "c.yaml")
    assert cfg.flags.plugin.device_list_strategy == ("cdi-cri",)


def test_show_output_reads_back_the_same() -> None:
    for cfg in (config.Config(), config.load(NVIDIA_V1), config.load(SHIPPED)):
        text = config.to_yaml(cfg)
        assert config.parse(text, cfg.source) == cfg
    # NVIDIA's camelCase keys, in NVIDIA's sections.
    data = yaml.safe_load(config.to_yaml(config.load(NVIDIA_V1)))
    assert list(data) == list(config.SECTIONS)
    assert data["flags"]["plugin"]["deviceListStrategy"] == ["envvar", "cdi-annotations"]
    assert data["sharing"]["timeSlicing"]["resources"][1]["devices"] == ["0:0", "0:1", "1:0"]


LONG = "a" * 64
# The start of an MPS resource entry, on line 4.
MPS = "sharing:\n  mps:\n    resources:\n    - "
TS = "sharing:\n  timeSlicing:\n    resources:\n    - "


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # Unknown keys, at every level.
        ("flags:\n  migStrategi: none\n", r"line 2: flags\.migStrategi: unknown key"),
        ("flags:\n  plugin:\n    passDeviceSpec: true\n", r"line 3: flags\.plugin\.passDeviceSpec: unknown key"),
        ("flags:\n  gfd:\n    oneShot: true\n", r"line 3: flags\.gfd\.oneShot: unknown key"),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replica: 2\n",
            r"line 5: sharing\.timeSlicing\.resources\[0\]\.replica: unknown key",
        ),
        ("sharing:\n  timeslicing: {}\n", r"line 2: sharing\.timeslicing: unknown key"),
        ("resources:\n  migs: []\n", r"line 2: resources\.migs: unknown key"),
        ("imex:\n  channelIds: [0]\n", r"line 2: imex\.channelIds: unknown key"),
        ("flags:\n  <<: {migStrategy: none}\n", r"line 2: flags\.<<: YAML merge keys"),
        # Wrong types.
        ("flags: []\n", r"line 1: flags must be a mapping"),
        ("flags:\n  failOnInitError: 'yes please'\n", r"line 2: flags\.failOnInitError: must be true or false"),
        ("flags:\n  gdsEnabled: 1\n", r"line 2: flags\.gdsEnabled: must be true or false, not '1'"),
        ("flags:\n  nvidiaDriverRoot: 5\n", r"line 2: flags\.nvidiaDriverRoot: must be a string, not '5'"),
        ("flags:\n  nvidiaDriverRoot: ''\n", r"line 2: flags\.nvidiaDriverRoot: must not be empty"),
        ("flags:\n  gfd:\n    sleepInterval: soon\n", r"line 3: flags\.gfd\.sleepInterval: must be a duration"),
        ("resources:\n  gpus: {}\n", r"line 2: resources\.gpus: must be a list"),
        ("sharing:\n  mps:\n    resources: gpu\n", r"line 3: sharing\.mps\.resources: must be a list"),
        ("imex:\n  required: maybe\n", r"line 2: imex\.required: must be true or false"),
        # Unknown strategies.
        ("flags:\n  migStrategy: all\n", r"line 2: flags\.migStrategy: must be one of none, single, mixed; not 'all'"),
        ("flags:\n  deviceDiscoveryStrategy: magic\n", r"line 2: flags\.deviceDiscoveryStrategy: must be one of"),
        ("flags:\n  plugin:\n    deviceIDStrategy: serial\n", r"line 3: flags\.plugin\.deviceIDStrategy: must be"),
        (
            "flags:\n  plugin:\n    deviceListStrategy: envvar,cdi-cri\n",
            r"line 3: flags\.plugin\.deviceListStrategy: must be one of envvar, volume-mounts, cdi-annotations, "
            "cdi-cri; not 'envvar,cdi-cri'",
        ),
        (
            "flags:\n  plugin:\n    deviceListStrategy:\n    - envvar\n    - cdi\n",
            r"line 5: flags\.plugin\.deviceListStrategy\[1\]: must be one of",
        ),
        (
            "flags:\n  plugin:\n    deviceListStrategy: [envvar, cdi-cri, envvar]\n",
            r"line 3: flags\.plugin\.deviceListStrategy\[2\]: envvar is listed twice",
        ),
        ("flags:\n  plugin:\n    deviceListStrategy: []\n", r"deviceListStrategy: must name at least one"),
        # Replicas and devices.
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 0\n",
            r"line 5: sharing\.timeSlicing\.resources\[0\]\.replicas: must be from 1 to 1024, not 0",
        ),
        (MPS + "{name: gpu, replicas: -3}\n", r"line 4: .*replicas: must be from 1"),
        (MPS + "{name: gpu, replicas: 2.5}\n", r"replicas: must be a number of"),
        (MPS + "{name: gpu, replicas: 1025}\n", r"replicas: must be from 1 to 1024"),
        (
            MPS + "name: gpu\n",
            r"line 4: sharing\.mps\.resources\[0\]\.replicas: required",
        ),
        (MPS + "{replicas: 2}\n", r"line 4: sharing\.mps\.resources\[0\]\.name: required"),
        (MPS + "{name: gpu, replicas: 2, devices: -1}\n", r"devices: a number of"),
        (MPS + "{name: gpu, replicas: 2, devices: 0}\n", r"devices: a number of"),
        (MPS + "{name: gpu, replicas: 2, devices: some}\n", r"devices: must be 'all'"),
        (MPS + "{name: gpu, replicas: 2, devices: []}\n", r"devices: lists no"),
        (
            MPS + "{name: gpu, replicas: 2, devices: [0, GPU-nope]}\n",
            r"line 4: sharing\.mps\.resources\[0\]\.devices\[1\]: 'GPU-nope' is not a GPU index",
        ),
        (
            MPS + "{name: gpu, replicas: 2, devices: [0, '00']}\n",
            r"devices\[1\]: device 0 is listed twice",
        ),
        (MPS + "{name: gpu, replicas: 2, devices: [-1]}\n", r"devices\[0\]: GPU index"),
        # Resource names.
        ("resources:\n  gpus:\n  - {pattern: '*', name: a.com/b/c}\n", r"gpus\[0\]\.name: 'a\.com/b/c'.*more than one"),
        ("resources:\n  gpus:\n  - {pattern: '*', name: kubernetes.io/gpu}\n", r"kubernetes\.io domain is reserved"),
        ("resources:\n  gpus:\n  - {pattern: '*', name: x.kubernetes.io/gpu}\n", r"kubernetes\.io domain is reserved"),
        ("resources:\n  gpus:\n  - {pattern: '*', name: Example.com/gpu}\n", r"'Example\.com' is not a DNS subdomain"),
        ("resources:\n  gpus:\n  - {pattern: '*', name: nvidia.com/-gpu}\n", r"'-gpu' is not a valid name"),
        (f"resources:\n  gpus:\n  - {{pattern: '*', name: {LONG}}}\n", r"is not a valid name .*at most 63"),
        (f"resources:\n  gpus:\n  - {{pattern: '*', name: {'a.' * 127}com/gpu}}\n", r"is not a DNS subdomain"),
        ("resources:\n  mig:\n  - {name: mig-1g.5gb}\n", r"line 3: resources\.mig\[0\]\.pattern: required"),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, rename: 'gpu shared', replicas: 2}\n",
            r"line 4: sharing\.timeSlicing\.resources\[0\]\.rename: 'gpu shared' is not a valid extended resource",
        ),
        (
            "sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
            f"    - {{name: {'g' * 60}, replicas: 2}}\n",
            r"line 5: sharing\.timeSlicing\.resources\[0\]\.name: renamed by default to nvidia\.com/g+\.shared",
        ),
        # Duplicates in sharing.
        (
            TS + "{name: gpu, replicas: 2}\n    - {name: nvidia.com/gpu, replicas: 3}\n",
            r"line 5: sharing\.timeSlicing\.resources\[1\]\.devices: every device of nvidia\.com/gpu also shared "
            r"by c\.yaml, line 4: sharing\.timeSlicing\.resources\[0\]",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n"
            "    - {name: mig-1g.5gb, rename: gpu, replicas: 3}\n",
            r"line 5: sharing\.timeSlicing\.resources\[1\]\.rename: nvidia\.com/gpu is advertised twice",
        ),
        # Across sections.
        (
            "sharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2}]\n  mps:\n"
            "    resources: [{name: gpu, replicas: 2}]\n",
            r"line 5: sharing\.mps: time-slicing and MPS are mutually exclusive",
        ),
        (
            "sharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources: [{name: gpu, replicas: 2}]\n",
            r"line 3: sharing\.mps\.failRequestsGreaterThanOne: must be true for MPS",
        ),
        (
            MPS + "{name: gpu, replicas: 2}\nnvplug:\n  mps:\n    resources: [{name: gpu.shared}]\n",
            r"line 7: nvplug\.mps\.resources\[0\]\.name: nvidia\.com/gpu\.shared is no MPS resource",
        ),
        (
            "nvplug:\n  mps:\n    resources: [{name: gpu, pinnedMemoryLimit: 4T}]\n",
            r"line 3: nvplug\.mps\.resources\[0\]\.pinnedMemoryLimit: must be a size such as 4096M",
        ),
        (
            "nvplug:\n  mps:\n    resources: [{name: gpu, activeThreadPercentage: 0}]\n",
            r"line 3: nvplug\.mps\.resources\[0\]\.activeThreadPercentage: must be from 1 to 100",
        ),
        (
            "nvplug:\n  mps:\n    resources: [{name: gpu}, {name: gpu}]\n",
            r"line 3: nvplug\.mps\.resources\[1\]\.name: nvidia\.com/gpu is listed twice",
        ),
        ("nvplug:\n  mps:\n    root: run/mps\n", r"line 3: nvplug\.mps\.root: 'run/mps' is not an absolute path"),
        (
            "nvplug:\n  dra:\n    kubeconfig: kube.conf\n",
            r"line 3: nvplug\.dra\.kubeconfig: 'kube\.conf' is neither auto, kubelet nor an absolute path",
        ),
        ("nvplug:\n  dra:\n    maxWritesPerSecond: 0\n", r"line 3: nvplug\.dra\.maxWritesPerSecond: must be positive"),
        (
            "nvplug:\n  dra:\n    maxWritesPerSecond: fast\n",
            r"line 3: nvplug\.dra\.maxWritesPerSecond: must be a number",
        ),
        ("imex:\n  channelIDs: [1]\n", r"line 2: imex\.channelIDs: must be \[\] or \[0\], not \[1\]"),
        ("imex:\n  channelIDs: [0, 0]\n", r"line 2: imex\.channelIDs: must be \[\] or \[0\]"),
    ],
)
def test_schema_violations_name_key_and_line(text: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=rf"^c\.yaml, {message}" if message.startswith("line") else message):
        config.parse(text, "c.yaml")


# --- nvplug's own section ---


def test_health_section(tmp_path: Path) -> None:
    text = """
nvplug:
  health:
    ignoreXids: [48, 0x4F]
    fatalXids: [13]
    reprobeInitialSeconds: 0.5
    reprobeMaxSeconds: 8
"""
    health = config.parse(text, "c.yaml").health
    assert health == config.HealthConfig(frozenset({48, 79}), frozenset({13}), 0.5, 8.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nvplug:\n  health:\n    ignoreXid: [1]\n", r"line 3: nvplug\.health\.ignoreXid: unknown key"),
        ("nvplug:\n  health:\n    ignoreXids: 13\n", r"line 3: nvplug\.health\.ignoreXids: must be a list"),
        ("nvplug:\n  health:\n    fatalXids: [x]\n", r"line 3: nvplug\.health\.fatalXids\[0\]: must be an XID number"),
        ("nvplug:\n  health:\n    fatalXids: [-4]\n", r"line 3: nvplug\.health\.fatalXids\[0\]: -4 is not an XID"),
        ("nvplug:\n  health:\n    reprobeMaxSeconds: 0\n", r"reprobeMaxSeconds: must be positive"),
        ("nvplug:\n  health:\n    reprobeMaxSeconds: '5'\n", r"reprobeMaxSeconds: must be a number"),
        ("nvplug:\n  health:\n    reprobeMaxSeconds: .nan\n", r"reprobeMaxSeconds: must be a number"),
        (
            "nvplug:\n  health:\n    ignoreXids: [79]\n    fatalXids: [79]\n",
            r"line 3: nvplug\.health: XIDs \[79\] are both",
        ),
        ("nvplug:\n  health:\n    reprobeInitialSeconds: 9\n    reprobeMaxSeconds: 3\n", "below"),
        ("nvplug:\n  health: []\n", r"line 2: nvplug\.health must be a mapping"),
        ("nvplug:\n  bogus: 1\n", r"line 2: nvplug\.bogus: unknown key"),
        ("version: v1\nversion: v1\n", r"line 2: version: given twice"),
    ],
)
def test_health_section_errors_name_key_and_line(text: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.parse(text, "c.yaml")


# --- hostile YAML ---


def _laughs(levels: int) -> str:
    """A billion laughs inside a list the schema reads: 10**levels items through nested aliases."""
    lines = ["sharing:", "  timeSlicing:", "    resources:", "    - name: gpu", "      replicas: 2", "      devices:"]
    lines.append("      - &l0 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]")
    lines += [f"      - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_yaml_bomb_is_refused_without_expanding_it() -> None:
    start = time.monotonic()
    with pytest.raises(config.ConfigError, match=r"line 7: sharing\.timeSlicing\.resources\[0\]\.devices\[0\]: "):
        config.parse(_laughs(9), "bomb.yaml")  # 10**9 nodes if expanded
    # The same bomb under a key that is not in the schema.
    with pytest.raises(config.ConfigError, match=r"line 1: bomb: unknown key"):
        config.parse("bomb:\n" + _laughs(9).replace("sharing:", "  x:"), "bomb.yaml")
    assert time.monotonic() - start < 10  # expanded, it would take hours


def test_aliases_that_fan_out_are_cut_off_at_the_node_limit() -> None:
    # Each resource is valid and shares one long device list: n * m nodes to read from n + m in the text.
    devices = ", ".join(str(i) for i in range(config.MAX_DEVICES))
    items = [f"    - {{name: r{i}, replicas: 2, devices: *d}}" for i in range(1, 400)]
    text = f"sharing:\n  timeSlicing:\n    resources:\n    - {{name: r0, replicas: 2, devices: &d [{devices}]}}\n"
    start = time.monotonic()
    with pytest.raises(config.ConfigError, match=r"more than 100000 YAML nodes \(aliases expanded\); refusing"):
        config.parse(text + "\n".join(items) + "\n", "fan.yaml")
    # The refusal is the proof; this catches a reading gone quadratic (it takes under 2 s when idle).
    assert time.monotonic() - start < 20


def test_deep_nesting_and_recursive_aliases_are_errors_not_crashes() -> None:
    with pytest.raises(config.ConfigError, match=r"not valid YAML: nested deeper than 64 levels"):
        config.parse("a: " + "[" * 20000 + "]" * 20000 + "\n", "deep.yaml")
    with pytest.raises(config.ConfigError, match=r"devices\[0\]: .* not a GPU index|devices\[0\]: must be"):
        config.parse(MPS + "{name: gpu, replicas: 2, devices: &a [*a]}\n", "r")
    with pytest.raises(config.ConfigError, match=r"nvplug\.health\.health: unknown key"):
        config.parse("nvplug: &n\n  health: *n\n", "r")


# --- the shipped config ---


def test_packaging_config_loads_commented_and_uncommented() -> None:
    assert config.load(SHIPPED) == config.Config(source=str(SHIPPED))
    lines = SHIPPED.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# From here on")) + 1
    text = "\n".join(lines[:at] + [line[1:] for line in lines[at:]])
    cfg = config.parse(text, "uncommented")
    assert cfg.flags == config.Flags()
    assert cfg.resources == config.Resources()
    assert cfg.sharing.time_slicing.resources == (config.ReplicatedResource("nvidia.com/gpu", 4),)
    assert cfg.imex == config.Imex()
    assert cfg.health == config.HealthConfig()


# --- nvplug config check / show ---


def _nvplug(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nvplug", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_config_check_through_the_cli(tmp_path: Path) -> None:
    ok = _nvplug("config", "check", str(NVIDIA_V1))
    assert (ok.returncode, ok.stdout) == (0, f"{NVIDIA_V1}: ok\n")
    # NVIDIA's file loads unchanged, and nvplug serves all of it (MIG time-slicing too): nothing to warn of.
    assert ok.stderr == ""
    typo = tmp_path / "typo.yaml"
    typo.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: a100\n      replicas: 2\n")
    warned = _nvplug("config", "check", str(typo))
    assert warned.returncode == 0
    assert warned.stderr == (
        f"{typo}: sharing.timeSlicing for nvidia.com/a100 is ignored: no device of this config is named so\n"
    )

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 0\n")
    failed = _nvplug("config", "check", str(bad))
    assert failed.returncode == 2
    assert failed.stdout == ""
    assert f"{bad}, line 6: sharing.timeSlicing.resources[0].replicas: must be from 1" in failed.stderr


def test_config_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "check", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml: no such config file" in capsys.readouterr().err


def test_config_show_through_the_cli() -> None:
    shown = _nvplug("config", "show", "--config", str(NVIDIA_V1))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"# nvplug config from {NVIDIA_V1}, every default filled in\n")
    assert config.parse(shown.stdout, str(NVIDIA_V1)) == config.load(NVIDIA_V1)
    assert "  gdrcopyEnabled: false\n" in shown.stdout  # a default the file leaves out


def test_config_show_defaults_and_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.yaml")
    assert cli.main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# nvplug config from built-in defaults")
    assert config.parse(out, "built-in defaults") == config.Config()

    bad = tmp_path / "bad.yaml"
    bad.write_text("flags:\n  migStrategy: all\n")
    assert cli.main(["config", "show", "--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{bad}, line 2: flags.migStrategy: must be one of none, single, mixed" in captured.err


def test_a_large_file_is_read_by_libyaml_with_pyyamls_errors_and_nodes() -> None:
    """Past FAST_FROM_BYTES libyaml scans (PyYAML's scanner takes seconds); what it reads is the same
    node tree, and a file it refuses is refused in PyYAML's words, as a small file is."""
    from nvplug.config import yaml_reader

    xids = ", ".join(["79"] * (yaml_reader.FAST_FROM_BYTES // 3))
    text = f"version: v1\nnvplug:\n  health:\n    fatalXids: [{xids}]\n"
    assert len(text) >= yaml_reader.FAST_FROM_BYTES
    assert config.parse(text, "big.yaml").health.fatal_xids == frozenset({79})
    fast = yaml.compose(text, Loader=yaml_reader._LOADERS[0])
    exact = yaml.compose(text, Loader=yaml_reader._LOADERS[-1])
    assert yaml.serialize(fast) == yaml.serialize(exact)
    broken = text.replace("fatalXids: [", "fatalXids: [[", 1)
    with pytest.raises(config.ConfigError) as big:
        config.parse(broken, "big.yaml")
    with pytest.raises(config.ConfigError) as small:
        config.parse("version: v1\nnvplug:\n  health:\n    fatalXids: [[79]\n", "big.yaml")
    assert "not valid YAML: while parsing a flow sequence" in str(big.value)
    assert str(big.value).splitlines()[:2] == str(small.value).splitlines()[:2]


def test_each_command_line_override_is_written_onto_its_key() -> None:
    cfg = config.parse("version: v1\nflags:\n  nvidiaDevRoot: /run/nvidia/driver\n", "c.yaml")
    assert config.overridden(cfg, config.Overrides()) == cfg  # nothing given: the file's keys hold
    out = config.overridden(
        cfg,
        config.Overrides(
            nvidia_dev_root=Path("/n/dev"),
            nvidia_ctk_path=Path("/n/bin/nvidia-ctk"),
            status_listen="unix:/n/status.sock",
            cdi_spec_dir=Path("/n/cdi"),
            cdi_runtime_dirs=(Path("/n/etc/cdi"), Path("/n/var/run/cdi")),
            feature_file=Path("/n/features.d/nvplug"),
            pod_resources_socket=Path("/n/kubelet.sock"),
            mps_root=Path("/n/mps"),
        ),
    )
    assert out.flags.nvidia_dev_root == "/n/dev"
    assert out.flags.plugin.nvidia_ctk_path == "/n/bin/nvidia-ctk"
    assert out.status_listen == "unix:/n/status.sock"
    assert out.cdi_spec_dir == "/n/cdi"
    assert out.cdi_runtime_dirs == ("/n/etc/cdi", "/n/var/run/cdi")
    assert out.feature_file == "/n/features.d/nvplug"
    assert out.pod_resources_socket == "/n/kubelet.sock"
    assert out.mps_root == "/n/mps"
    # The rest of the file is untouched, and a flag's path named `off` is a path, never the key's `off`.
    assert out.flags.nvidia_driver_root == cfg.flags.nvidia_driver_root and out.source == cfg.source
    assert config.off_or_path(config.overridden(cfg, config.Overrides(cdi_spec_dir=Path("off"))).cdi_spec_dir)


def test_a_bare_off_turns_a_path_or_listener_off() -> None:
    """YAML 1.1 reads a bare `off` as false: for the keys that take `off`, it is `off`; elsewhere a bool
    is still refused where a string belongs."""
    text = (
        "version: v1\nnvplug:\n  cdi:\n    specDir: off\n  status:\n    listen: off\n    metricsListen: off\n"
        "  telemetry:\n    naming: nvplug\n"
    )
    cfg = config.parse(text, "off.yaml")
    assert (cfg.cdi_spec_dir, cfg.status_listen, cfg.metrics_listen) == ("off", "off", "off")
    assert cfg.telemetry.naming == "nvplug"
    with pytest.raises(config.ConfigError, match="must be a string"):
        config.parse("version: v1\nnvplug:\n  status:\n    metricsListen: no\n", "no.yaml")
