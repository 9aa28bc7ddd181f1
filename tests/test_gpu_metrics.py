"""The dcgm naming's pod labels (`nvplug.telemetry.podLabels`, `podUid`, `podLabelNames`), rendered from a
snapshot, who holds each device and a scrape's readings: dcgm-exporter's `--kubernetes` series, with each
pod's own figures on a shared GPU. The daemon's part (PodResources, processes in real cgroups) is in
test_telemetry.py."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nvplug.config import ConfigError, TelemetryConfig, parse
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.snapshot import Snapshot
from nvplug.core.telemetry import GpuFigures, GpuReading, MigFigures, ProcessContainer, ProcessUse, Telemetry
from nvplug.pods.pod_holders import Holder
from nvplug.status.gpu_metrics import GpuMetrics

Samples = list[tuple[dict[str, str], float]]
SHARED, WHOLE, FREE, MIG_GPU, MIG = "GPU-shared", "GPU-whole", "GPU-free", "GPU-mig", "MIG-0"
A = ProcessContainer("ml", "ts-a", "main", "uid-a", "c-a")
B = ProcessContainer("ml", "ts-b", "main", "uid-b", "c-b")
C = ProcessContainer("ml", "trainer", "main", "uid-c", "c-c")


def holder(pod: str, device: str, replica: int | None = None, claim: str | None = None) -> Holder:
    resource = "gpu.nvidia.com" if claim else "nvidia.com/gpu"
    return Holder("ml", pod, "main", resource, device, replica, claim, "node-a" if claim else None)


HOLDERS = {
    # Two pods on replicas of one GPU, one of them on two replicas: each pod is one holder.
    SHARED: [holder("ts-a", f"{SHARED}::0", 0), holder("ts-a", f"{SHARED}::2", 2), holder("ts-b", f"{SHARED}::1", 1)],
    WHOLE: [holder("trainer", WHOLE)],
    MIG: [holder("mig-user", "gpu-3-mig-1-0", claim="gpu-claim")],
}


def rendered(
    pod_labels: bool,
    holders: dict[str, list[Holder]] = HOLDERS,
    settings: TelemetryConfig | None = None,
    pod_uids: dict[tuple[str, str], str] | None = None,
    before: TelemetryConfig | None = None,
) -> dict[str, Samples]:
    """The series of one render; after one with the settings `before`, where given (a reload between)."""
    gpus = (
        Gpu(SHARED, 0, "0000:01:00.0", 0, name="H100"),
        Gpu(WHOLE, 1, "0000:02:00.0", 1, name="H100"),
        Gpu(FREE, 2, "0000:03:00.0", 2, name="H100"),
        Gpu(MIG_GPU, 3, "0000:04:00.0", 3, name="H100", mig_enabled=True, mig=(MigDevice(MIG, 1, 0, "3g.40gb"),)),
    )
    snapshot = Snapshot(1, gpus, xid_codes=MappingProxyType({SHARED: ((31, 1),)}))
    figures = GpuFigures(util_gpu=90, util_memory=40, fb_used_mib=6000, fb_total_mib=81559, temperature_c=60)
    telemetry = Telemetry(
        (
            GpuReading(
                SHARED,
                1.0,
                figures,
                processes=(
                    ProcessUse(11, SHARED, "compute", 1024.0, 50.0, 20.0),
                    ProcessUse(12, SHARED, "compute", 512.0, 10.0, 5.0),
                    ProcessUse(21, SHARED, "compute", 4096.0, 30.0, 15.0),
                    ProcessUse(99, SHARED, "compute", 100.0, 0.0, 0.0),  # a host process: nobody's
                ),
            ),
            GpuReading(WHOLE, 1.0, figures, processes=(ProcessUse(31, WHOLE, "compute", 2000.0, 80.0, 30.0),)),
            GpuReading(FREE, 1.0, figures),
            GpuReading(
                MIG_GPU,
                1.0,
                GpuFigures(fb_total_mib=81559),
                (MigFigures(MIG, 2048, 38000, 40448),),
                (ProcessUse(41, MIG, "compute", 2048.0),),
            ),
        ),
        {11: A, 12: A, 21: B, 31: C, 41: ProcessContainer("ml", "mig-user", "main")},
        pod_uids or {},
    )
    final = settings or TelemetryConfig(pod_labels=pod_labels)
    config = before or final
    metrics = GpuMetrics(lambda: snapshot, lambda: holders, lambda: config, "node-a")
    if before is not None:
        metrics.render(telemetry)
        config = final
    out: dict[str, Samples] = {}
    for family in text_string_to_metric_families(metrics.render(telemetry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def of(samples: dict[str, Samples], name: str, **labels: str) -> list[float]:
    return [v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]


def test_without_pod_labels_each_device_has_one_series_and_no_pod() -> None:
    got = rendered(pod_labels=False)
    assert len(got["DCGM_FI_DEV_FB_TOTAL"]) == 5  # four GPUs and a MIG device
    assert not [lab for family in got.values() for lab, _ in family if "pod" in lab and "device_uuid" not in lab]
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED) == [90]


def test_a_gpu_shared_by_two_pods_shows_each_pod_s_own_utilization_and_memory() -> None:
    got = rendered(pod_labels=True)
    # ts-a's two processes summed (its two replicas are one holder); ts-b's one; the host's process is neither's.
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, pod="ts-a", namespace="ml", container="main") == [60]
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, pod="ts-b") == [30]
    assert of(got, "DCGM_FI_DEV_MEM_COPY_UTIL", UUID=SHARED, pod="ts-a") == [25]
    assert of(got, "DCGM_FI_DEV_FB_USED", UUID=SHARED, pod="ts-a") == [1536]
    assert of(got, "DCGM_FI_DEV_FB_USED", UUID=SHARED, pod="ts-b") == [4096]
    # What is the device's alone is copied to each pod, as dcgm-exporter does.
    assert of(got, "DCGM_FI_DEV_GPU_TEMP", UUID=SHARED) == [60, 60]
    assert of(got, "DCGM_FI_DEV_XID_ERRORS", UUID=SHARED) == [31, 31]
    assert of(got, "nvplug_gpu_xid_errors_total", UUID=SHARED) == [1]  # nvplug's own: once a GPU
    assert not of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, pod="")  # no copy for nobody


def test_a_whole_gpu_s_pod_gets_the_device_s_figures_and_a_free_gpu_no_pod() -> None:
    got = rendered(pod_labels=True)
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=WHOLE, pod="trainer") == [90]
    assert of(got, "DCGM_FI_DEV_FB_USED", UUID=WHOLE, pod="trainer") == [6000]
    ((labels, _),) = [s for s in got["DCGM_FI_DEV_GPU_TEMP"] if s[0]["UUID"] == FREE]
    assert "pod" not in labels and labels["Hostname"] == "node-a"


def test_a_mig_device_s_series_carry_its_claim() -> None:
    got = rendered(pod_labels=True)
    ((labels, used),) = [s for s in got["DCGM_FI_DEV_FB_USED"] if s[0].get("GPU_I_ID") == "1"]
    assert used == 2048
    assert labels["pod"] == "mig-user" and labels["dra_claim_name"] == "gpu-claim"
    assert labels["dra_driver_name"] == "gpu.nvidia.com" and labels["dra_pool_name"] == "node-a"
    assert (labels["dra_mig_profile"], labels["dra_mig_device_uuid"]) == ("3g.40gb", MIG)
    # The container's own series name the MIG device the claim got, too.
    ((own, _),) = [s for s in got["nvplug_container_gpu_memory_used_bytes"] if s[0]["pod"] == "mig-user"]
    assert (own["pod"], own["dra_claim_name"], own["dra_mig_device_uuid"]) == ("mig-user", "gpu-claim", MIG)
    # The whole GPU's own series: nobody holds the GPU itself.
    ((whole, _),) = [s for s in got["DCGM_FI_DEV_FB_TOTAL"] if s[0]["UUID"] == MIG_GPU and "GPU_I_ID" not in s[0]]
    assert "pod" not in whole


def test_a_pod_sharing_a_gpu_with_no_process_on_it_is_at_0() -> None:
    holders = dict(HOLDERS) | {SHARED: [*HOLDERS[SHARED], holder("idle", f"{SHARED}::3", 3)]}
    got = rendered(pod_labels=True, holders=holders)
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, pod="idle") == [0]
    assert of(got, "DCGM_FI_DEV_FB_USED", UUID=SHARED, pod="idle") == [0]


def test_pod_labels_are_off_by_default_and_for_the_dcgm_naming_only() -> None:
    assert parse("version: v1\n", "config.yaml").telemetry.pod_labels is False
    on = parse("version: v1\nnvplug:\n  telemetry:\n    podLabels: true\n", "config.yaml")
    assert on.telemetry.pod_labels is True
    with pytest.raises(ConfigError, match=r"line 5: nvplug\.telemetry\.podLabels: .*dcgm naming"):
        parse("version: v1\nnvplug:\n  telemetry:\n    naming: nvplug\n    podLabels: true\n", "config.yaml")


def test_pod_uid_from_the_cgroup_on_a_container_s_series_and_from_the_records_on_a_holder_s() -> None:
    """dcgm-exporter's --kubernetes-enable-pod-uid. A holder whose name the records give twice (a pod made
    again under its old name) or not at all has an empty pod_uid, never a guess."""
    got = rendered(
        pod_labels=True,
        settings=TelemetryConfig(pod_labels=True, pod_uid=True),
        pod_uids={("ml", "ts-a"): "uid-a", ("ml", "trainer"): "uid-c"},
    )
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, pod="ts-a", pod_uid="uid-a") == [60]
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, pod="ts-b", pod_uid="") == [30]
    assert of(got, "DCGM_FI_DEV_GPU_TEMP", UUID=WHOLE, pod="trainer", pod_uid="uid-c") == [60]
    # Per container, the UID is the process's own cgroup's: ts-b's too.
    assert of(got, "nvplug_container_gpu_processes", pod="ts-b", pod_uid="uid-b") == [1]
    assert of(got, "nvplug_container_gpu_processes", pod="ts-a", pod_uid="uid-a") == [2]
    # Without it, no series has the label.
    plain = rendered(pod_labels=True, pod_uids={("ml", "ts-a"): "uid-a"})
    assert not [lab for family in plain.values() for lab, _ in family if "pod_uid" in lab]


def test_legacy_pod_label_names() -> None:
    """dcgm-exporter's --use-old-namespace: pod_name, pod_namespace and container_name, on the device copies
    and the container series alike, and no pod, namespace or container label beside them."""
    got = rendered(pod_labels=True, settings=TelemetryConfig(pod_labels=True, pod_label_names="legacy"))
    at = {"pod_name": "ts-a", "pod_namespace": "ml", "container_name": "main"}
    assert of(got, "DCGM_FI_DEV_GPU_UTIL", UUID=SHARED, **at) == [60]
    assert of(got, "nvplug_container_gpu_memory_used_bytes", pod_name="ts-b") == [4096 * 2**20]
    assert not [lab for family in got.values() for lab, _ in family if {"pod", "namespace", "container"} & set(lab)]


def test_pod_uid_and_legacy_names_in_the_config() -> None:
    plain = parse("version: v1\n", "config.yaml").telemetry
    assert (plain.pod_uid, plain.pod_label_names) == (False, "current")
    on = parse("version: v1\nnvplug:\n  telemetry:\n    podUid: true\n    podLabelNames: legacy\n", "c.yaml")
    assert (on.telemetry.pod_uid, on.telemetry.pod_label_names) == (True, "legacy")
    nvplug = parse("version: v1\nnvplug:\n  telemetry:\n    naming: nvplug\n    podUid: true\n", "c.yaml")
    assert nvplug.telemetry.pod_uid is True  # nvplug's container series carry it too
    with pytest.raises(ConfigError, match=r"line 5: nvplug\.telemetry\.podLabelNames: .*dcgm naming"):
        parse("version: v1\nnvplug:\n  telemetry:\n    naming: nvplug\n    podLabelNames: legacy\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"podLabelNames: must be one of current, legacy; not 'old'"):
        parse("version: v1\nnvplug:\n  telemetry:\n    podLabelNames: old\n", "c.yaml")


def test_a_reload_that_renames_the_pod_labels_renames_every_container_s_series() -> None:
    """A container's label text is kept from scrape to scrape: not past a change of how pods are named."""
    got = rendered(pod_labels=False, settings=TelemetryConfig(pod_uid=True), before=TelemetryConfig())
    assert of(got, "nvplug_container_gpu_processes", pod="ts-a", pod_uid="uid-a") == [2]
