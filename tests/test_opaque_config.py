"""Opaque device configuration in NVIDIA's API (resource.nvidia.com/v1beta1 GpuConfig, MigDeviceConfig):
NVIDIA's documented examples decoded, each refusal with its field, the order of precedence of the
class's and the claim's entries, and what prepare answers for each."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from test_dra import DRIVER, NODE, REF, cdi_ids, claim, dra_device, gpu, pool_of, result

from nvplug.dra import claims
from nvplug.dra import opaque_config as oc
from nvplug.dra.claims import ClaimError
from nvplug.dra.dra_devices import DraDevice

# The claim of NVIDIA's demo (gpu-test5): one request time-sliced, one shared through MPS.
NVIDIA_EXAMPLE = """
- requests: ["ts-gpu"]
  opaque:
    driver: gpu.nvidia.com
    parameters:
      apiVersion: resource.nvidia.com/v1beta1
      kind: GpuConfig
      sharing:
        strategy: TimeSlicing
        timeSlicingConfig:
          interval: Long
- requests: ["mps-gpu"]
  opaque:
    driver: gpu.nvidia.com
    parameters:
      apiVersion: resource.nvidia.com/v1beta1
      kind: GpuConfig
      sharing:
        strategy: MPS
        mpsConfig:
          defaultActiveThreadPercentage: 50
          defaultPinnedDeviceMemoryLimit: 10Gi
          defaultPerDevicePinnedMemoryLimit:
            "0": 5Gi
"""
# NVIDIA's MIG example: a MIG device shared through MPS.
MIG_EXAMPLE = """
apiVersion: resource.nvidia.com/v1beta1
kind: MigDeviceConfig
sharing:
  strategy: MPS
  mpsConfig:
    defaultActiveThreadPercentage: 25
"""


def entries(text: str, source: str = "FromClaim") -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = [{**e, "source": source} for e in yaml.safe_load(text)]
    return found


def test_nvidias_examples_decode() -> None:
    ts, mps = (oc.decode(e["opaque"]["parameters"], "config") for e in entries(NVIDIA_EXAMPLE))
    assert ts == oc.DeviceConfig(oc.GPU_CONFIG, oc.ClaimSharing("TimeSlicing", "Long"), "config")
    assert mps.sharing == oc.ClaimSharing("MPS", mps=oc.ClaimMps(50, 10 * 1024, {"0": 5 * 1024}))
    mig = oc.decode(yaml.safe_load(MIG_EXAMPLE), "config")
    assert mig.kind == oc.MIG_CONFIG and mig.sharing == oc.ClaimSharing("MPS", mps=oc.ClaimMps(25))
    # No sharing at all: the GPU is the claim's alone; a TimeSlicing entry without an interval is Default's.
    plain = {"apiVersion": oc.API_VERSION, "kind": oc.GPU_CONFIG}
    assert oc.decode(plain, "c") == oc.DeviceConfig(oc.GPU_CONFIG, None, "c")
    assert oc.decode({**plain, "sharing": {"strategy": "TimeSlicing"}}, "c").sharing == oc.ClaimSharing("TimeSlicing")


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"apiVersion": "resource.nvidia.com/v1alpha1"}, "c: apiVersion 'resource.nvidia.com/v1alpha1' is not"),
        ({"kind": "TpuConfig"}, "c: kind 'TpuConfig' is neither GpuConfig nor MigDeviceConfig"),
        ({"shareing": {}}, "c: unknown field 'shareing'"),
        ({"sharing": []}, "c: sharing: must be an object, not list"),
        ({"sharing": {"strategy": "Sliced"}}, "c: sharing.strategy: unknown sharing strategy: 'Sliced'"),
        ({"sharing": {"strategy": "Fabric"}}, "c: sharing.strategy: the Fabric sharing strategy is not enabled"),
        (
            {"sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}},
            "c: sharing: cannot use mpsConfig with the TimeSlicing strategy",
        ),
        (
            {"sharing": {"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}},
            "c: sharing: cannot use timeSlicingConfig with the MPS strategy",
        ),
        (
            {"sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}},
            "c: sharing.timeSlicingConfig.interval: unknown time-slice interval: 'Forever'",
        ),
        (
            {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}},
            "c: sharing.mpsConfig.defaultActiveThreadPercentage: 101 is not between 0 and 100",
        ),
        (
            {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}},
            "c: sharing.mpsConfig.defaultActiveThreadPercentage: '50' is not an integer",
        ),
        (
            {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}},
            "c: sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 'lots' is not a quantity",
        ),
        (
            {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}},
            "c: sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: '512Ki' is too low",
        ),
        (
            {"sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}}},
            "c: sharing.mpsConfig: unknown field 'multiUser'",
        ),
        (
            {"kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}},
            "c: sharing.strategy: a MIG device is shared through MPS only",
        ),
    ],
)
def test_what_nvidias_driver_refuses_is_refused_with_its_field(change: dict[str, Any], error: str) -> None:
    with pytest.raises(oc.OpaqueConfigError) as found:
        oc.decode({"apiVersion": oc.API_VERSION, "kind": oc.GPU_CONFIG, **change}, "c")
    assert str(found.value).startswith(error), found.value


@pytest.mark.parametrize(("text", "mib"), [("10Gi", 10240), ("1G", 953), ("1536Mi", 1536), ("2e9", 1907), (3 << 20, 3)])
def test_quantities(text: str | int, mib: int) -> None:
    assert oc.mebibytes(text, "q") == mib


@pytest.mark.parametrize("text", ["1e40", "1e999999999", "-1Gi", "10 Gi", True])
def test_a_quantity_nvplug_cannot_take_fails_that_claim_alone(text: Any) -> None:
    # Never an exception other than the config's: the other claims of the call are answered.
    with pytest.raises(oc.OpaqueConfigError, match=r"^q: "):
        oc.mebibytes(text, "q")


def gpu_config(interval: str) -> dict[str, Any]:
    sharing = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}
    return {"apiVersion": oc.API_VERSION, "kind": oc.GPU_CONFIG, "sharing": sharing}


def test_the_class_comes_first_and_the_last_entry_for_a_request_wins() -> None:
    def entry(source: str, interval: str, requests: list[str] | None = None, driver: str = DRIVER) -> dict[str, Any]:
        out: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": gpu_config(interval)}}
        return {**out, "requests": requests} if requests is not None else out

    allocation = {
        "devices": {
            "config": [
                entry("FromClaim", "Short", ["a"]),
                entry("FromClass", "Medium"),
                entry("FromClaim", "Long", ["b"], driver="other.example.com"),
                entry("FromClass", "Default", ["b"]),
            ]
        }
    }
    found = oc.applicable(allocation, DRIVER)
    # The class's entries first, in their order; another driver's left out.
    assert [w for _, _, w in found] == ["config[1] (the DeviceClass)", "config[3] (the DeviceClass)",
                                        "config[0] (the claim)"]  # fmt: skip

    def interval(request: str) -> str | None:
        chosen = oc.for_request(found, request)
        return chosen.sharing.interval if chosen is not None and chosen.sharing is not None else None

    # The claim's entry for `a` beats the class's for every request; `b` has the class's own; a subrequest
    # takes its request's.
    assert (interval("a"), interval("b"), interval("c"), interval("a/small")) == ("Short", "Default", "Medium", "Short")
    assert oc.for_request([], "a") is None


def allocated_with(configs: list[dict[str, Any]], *results: dict[str, Any]) -> dict[str, Any]:
    doc = claim(list(results))
    doc["status"]["allocation"]["devices"]["config"] = configs
    return doc


def prepare(doc: dict[str, Any], *devices: DraDevice) -> claims.PreparedClaim:
    return claims.prepare(REF, doc, DRIVER, NODE, pool_of(*devices), cdi_ids)


def test_what_prepare_answers_for_each_config() -> None:
    d0 = dra_device(0)
    parameters = {"apiVersion": oc.API_VERSION, "kind": oc.GPU_CONFIG}
    plain = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}]
    assert prepare(allocated_with(plain, result("gpu-000")), d0).devices[0].device == "gpu-000"
    # NVIDIA's example: each request's device carries its sharing, for prepare to set up and unprepare to undo.
    doc = allocated_with(entries(NVIDIA_EXAMPLE), result("gpu-000", request="ts-gpu"))
    (sliced,) = prepare(doc, d0).devices
    print(f"NVIDIA's time-slicing example: {sliced.sharing}")
    assert sliced.sharing == oc.ClaimSharing("TimeSlicing", "Long")
    doc = allocated_with(entries(NVIDIA_EXAMPLE), result("gpu-000", request="mps-gpu"))
    (shared,) = prepare(doc, d0).devices
    print(f"NVIDIA's MPS example: {shared.sharing}")
    assert shared.sharing == oc.ClaimSharing("MPS", mps=oc.ClaimMps(50, 10240, {"0": 5120}))
    # A bad entry fails the claim alone, naming the field.
    bad = entries(NVIDIA_EXAMPLE)
    bad[1]["opaque"]["parameters"]["sharing"]["mpsConfig"]["defaultActiveThreadPercentage"] = 150
    with pytest.raises(ClaimError, match=r"request mps-gpu: config\[1\] \(the claim\): sharing\.mpsConfig\."
                                         r"defaultActiveThreadPercentage: 150 is not between 0 and 100"):  # fmt: skip
        prepare(allocated_with(bad, result("gpu-000", request="mps-gpu")), d0)
    # A request the entries do not name is prepared as it is.
    assert prepare(allocated_with(entries(NVIDIA_EXAMPLE), result("gpu-000", request="other")), d0).devices


def test_a_config_of_the_wrong_kind_and_mps_before_volta_are_refused() -> None:
    mig_config = [{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": yaml.safe_load(MIG_EXAMPLE)}}]
    with pytest.raises(ClaimError, match=r"a MigDeviceConfig cannot configure gpu-000, a GPU \(use GpuConfig\)"):
        prepare(allocated_with(mig_config, result("gpu-000")), dra_device(0))
    pascal = DraDevice("gpu-001", gpu(1, compute_capability=(6, 0)), None, True, "", {}, {})
    mps = [e for e in entries(NVIDIA_EXAMPLE) if e["requests"] == ["mps-gpu"]]
    with pytest.raises(ClaimError, match=r"MPS needs a Volta or newer GPU; gpu-001 is compute capability 6\.0"):
        prepare(allocated_with(mps, result("gpu-001", request="mps-gpu")), pascal)
