"""GPU telemetry as Prometheus series, in one of two namings (`nvplug.telemetry.naming`):

- `dcgm` (the default): dcgm-exporter's names, labels and units before its 4.9.0 renames
  (`DCGM_FI_DEV_GPU_UTIL` in percent, `DCGM_FI_DEV_FB_USED` in MiB, clocks in MHz, energy in mJ), so that
  dashboards built on them (Grafana 12239) work unchanged;
- `nvplug`: nvplug's own, in base units (ratios, bytes, hertz, joules), documented in docs/telemetry.md.

The per-container series are nvplug's in both (`nvplug_container_gpu_*`): dcgm-exporter has no names of
its own for them. So are `nvplug_gpu_metrics_stale` and the read's time. With `nvplug.telemetry.podLabels`,
the dcgm naming's device series carry the pods that hold the device, as dcgm-exporter's `--kubernetes` does;
`podUid` adds each pod's UID and `podLabelNames: legacy` gives the pod labels its old names, as its
`--kubernetes-enable-pod-uid` and `--use-old-namespace` do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nvplug.config.model import MetricNaming, TelemetryConfig
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.snapshot import Snapshot
from nvplug.core.telemetry import (
    HOST,
    MIB,
    VIOLATION_POLICIES,
    GpmActivity,
    GpuReading,
    ProcessContainer,
    ProcessUse,
    Telemetry,
    in_unit,
)
from nvplug.pods.pod_holders import Holder
from nvplug.status.prometheus_text import Families, label_text


@dataclass(frozen=True)
class Series:
    """One figure: its dcgm-exporter name, and nvplug's family with the labels that tell it apart there
    (None: a figure the naming has no series for)."""

    figure: str  # a GpuFigures field
    dcgm: str | None
    nvplug: str | None
    scale: float  # from the figure's unit to nvplug's
    counter: bool
    help: str
    labels: tuple[tuple[str, str], ...] = ()


GPU_SERIES = (
    Series("util_gpu", "DCGM_FI_DEV_GPU_UTIL", "nvplug_gpu_utilization_ratio", 0.01, False, "GPU utilization"),
    Series(
        "util_memory",
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "nvplug_gpu_memory_utilization_ratio",
        0.01,
        False,
        "Memory bandwidth utilization",
    ),
    Series(
        "util_encoder",
        "DCGM_FI_DEV_ENC_UTIL",
        "nvplug_gpu_encoder_utilization_ratio",
        0.01,
        False,
        "Video encoder utilization",
    ),
    Series(
        "util_decoder",
        "DCGM_FI_DEV_DEC_UTIL",
        "nvplug_gpu_decoder_utilization_ratio",
        0.01,
        False,
        "Video decoder utilization",
    ),
    Series("fb_used_mib", "DCGM_FI_DEV_FB_USED", "nvplug_gpu_framebuffer_used_bytes", MIB, False, "Framebuffer used"),
    Series("fb_free_mib", "DCGM_FI_DEV_FB_FREE", "nvplug_gpu_framebuffer_free_bytes", MIB, False, "Framebuffer free"),
    Series(
        "fb_total_mib", "DCGM_FI_DEV_FB_TOTAL", "nvplug_gpu_framebuffer_total_bytes", MIB, False, "Framebuffer size"
    ),
    Series("temperature_c", "DCGM_FI_DEV_GPU_TEMP", "nvplug_gpu_temperature_celsius", 1, False, "GPU temperature"),
    Series(
        "memory_temperature_c",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "nvplug_gpu_memory_temperature_celsius",
        1,
        False,
        "Memory (HBM) temperature",
    ),
    Series("power_w", "DCGM_FI_DEV_POWER_USAGE", "nvplug_gpu_power_watts", 1, False, "Power draw"),
    Series(
        "energy_mj",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "nvplug_gpu_energy_joules",
        0.001,
        True,
        "Energy used since the driver loaded",
    ),
    Series("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "nvplug_gpu_sm_clock_hertz", 1e6, False, "SM clock"),
    Series("memory_clock_mhz", "DCGM_FI_DEV_MEM_CLOCK", "nvplug_gpu_memory_clock_hertz", 1e6, False, "Memory clock"),
    Series(
        "clock_event_reasons",
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "nvplug_gpu_clock_event_reasons",
        1,
        False,
        "What holds the clocks down (nvmlClocksEventReasons bits)",
    ),
    *(
        Series(
            f"ecc_{kind}_{counter}",
            f"DCGM_FI_DEV_ECC_{kind.upper()}_{counter[:3].upper()}_TOTAL",
            "nvplug_gpu_ecc_errors",
            1,
            True,
            "ECC errors",
            (("error", "corrected" if kind == "sbe" else "uncorrected"), ("counter", counter)),
        )
        for kind in ("sbe", "dbe")
        for counter in ("volatile", "aggregate")
    ),
    Series(
        "retired_pages_sbe",
        "DCGM_FI_DEV_RETIRED_SBE",
        "nvplug_gpu_retired_pages",
        1,
        False,
        "Retired pages",
        (("cause", "single_bit"),),
    ),
    Series(
        "retired_pages_dbe",
        "DCGM_FI_DEV_RETIRED_DBE",
        "nvplug_gpu_retired_pages",
        1,
        False,
        "Retired pages",
        (("cause", "double_bit"),),
    ),
    Series(
        "retired_pages_pending",
        "DCGM_FI_DEV_RETIRED_PENDING",
        "nvplug_gpu_retired_pages_pending",
        1,
        False,
        "1 while a page retirement waits for a reset",
    ),
    Series(
        "remapped_rows_correctable",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "nvplug_gpu_remapped_rows",
        1,
        False,
        "Rows remapped",
        (("error", "corrected"),),
    ),
    Series(
        "remapped_rows_uncorrectable",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "nvplug_gpu_remapped_rows",
        1,
        False,
        "Rows remapped",
        (("error", "uncorrected"),),
    ),
    Series(
        "remapped_rows_pending",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "nvplug_gpu_row_remap_pending",
        1,
        False,
        "1 while a row remap waits for a reset",
    ),
    Series(
        "remapped_rows_failure",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "nvplug_gpu_row_remap_failure",
        1,
        False,
        "1 once a row remap failed",
    ),
    Series("pcie_replays", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "nvplug_gpu_pcie_replays", 1, True, "PCIe replays"),
    # NVLink: nvplug's are NVML's counters (rate() them over any range); DCGM's is its own rate over the
    # window since the last read, in its unit, as dcgm-exporter shows it.
    *(
        Series(
            f"nvlink_{direction}_kib",
            None,
            "nvplug_gpu_nvlink_data_bytes",
            1024,
            True,
            "NVLink data over all links since the GPU's last reset",
            (("direction", direction),),
        )
        for direction in ("tx", "rx")
    ),
    Series(
        "nvlink_bandwidth_total",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        None,
        1,
        False,
        "NVLink throughput over all links, both ways (in MB/s)",
    ),
    # NVML's violation times, in ns as DCGM gives them (its older headers said us; its value never was).
    *(
        Series(
            f"{policy}_violation_ns",
            f"DCGM_FI_DEV_{'LOW_UTIL' if policy == 'low_utilization' else policy.upper()}_VIOLATION",
            "nvplug_gpu_violation_seconds",
            1e-9,
            True,
            "Time a policy held the clocks below the applications clocks",
            (("policy", policy),),
        )
        for policy in VIOLATION_POLICIES
    ),
    # GPM's activity over the window since the last read: ratios in both namings, as DCGM's PROF fields.
    Series(
        "gr_engine_active",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "nvplug_gpu_graphics_engine_active_ratio",
        1,
        False,
        "Share of time the graphics or compute engine was busy",
    ),
    Series("sm_active", "DCGM_FI_PROF_SM_ACTIVE", "nvplug_gpu_sm_active_ratio", 1, False, "Share of SMs busy"),
    Series(
        "sm_occupancy",
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "nvplug_gpu_sm_occupancy_ratio",
        1,
        False,
        "Warps resident on the SMs, of the most they hold",
    ),
    Series(
        "tensor_active",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "nvplug_gpu_tensor_active_ratio",
        1,
        False,
        "Share of time the tensor cores were busy",
    ),
    Series(
        "dram_active",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "nvplug_gpu_dram_active_ratio",
        1,
        False,
        "Share of the memory bandwidth used",
    ),
    *(
        Series(
            f"{pipe}_active",
            f"DCGM_FI_PROF_PIPE_{pipe.upper()}_ACTIVE",
            "nvplug_gpu_pipe_active_ratio",
            1,
            False,
            "Share of time a pipe was busy",
            (("pipe", pipe),),
        )
        for pipe in ("fp64", "fp32", "fp16")
    ),
    *(
        Series(
            f"pcie_{direction}_bytes_per_second",
            f"DCGM_FI_PROF_PCIE_{direction.upper()}_BYTES",
            "nvplug_gpu_pcie_throughput_bytes_per_second",
            1,
            False,
            "PCIe throughput",
            (("direction", direction),),
        )
        for direction in ("tx", "rx")
    ),
)
# A MIG device's: its framebuffer, and its GPU instance's GPM activity.
MIG_SERIES = tuple(
    s for s in GPU_SERIES if s.figure.startswith("fb_") or s.figure in {f.name for f in dataclasses.fields(GpmActivity)}
)
# The GPU's labels a container's series carry: what the others join on.
JOIN_LABELS = frozenset({"gpu", "UUID", "uuid", "Hostname", "hostname"})
# The families per container and device: name, help, type.
CONTAINER_PROCESSES = ("nvplug_container_gpu_processes", "The container's processes on the device", "gauge")
CONTAINER_MEMORY = ("nvplug_container_gpu_memory_used_bytes", "GPU memory the container's processes use", "gauge")
CONTAINER_SM = (
    "nvplug_container_gpu_utilization_ratio",
    "SM utilization of the container's processes over the window since the last read",
    "gauge",
)
CONTAINER_MEMORY_UTIL = (
    "nvplug_container_gpu_memory_utilization_ratio",
    "Memory bandwidth utilization of the container's processes over the window since the last read",
    "gauge",
)
# A container's labels are the same scrape after scrape: their text is kept, for this many.
CONTAINER_TEXTS = 8192


# The labels for a pod's namespace, the pod and its container: dcgm-exporter's, and its --use-old-namespace's.
POD_LABEL_NAMES = {
    "current": ("namespace", "pod", "container"),
    "legacy": ("pod_namespace", "pod_name", "container_name"),
}


@dataclass(frozen=True)
class PodLabelling:
    """How a series names its pod: the labels for namespace, pod and container (`podLabelNames`), and
    whether it adds the pod's UID (`podUid`)."""

    names: tuple[str, str, str] = POD_LABEL_NAMES["current"]
    uid: bool = False

    @staticmethod
    def of(settings: TelemetryConfig) -> PodLabelling:
        return PodLabelling(POD_LABEL_NAMES[settings.pod_label_names], settings.pod_uid)

    def labels(self, namespace: str, pod: str, container: str, uid: str) -> dict[str, str]:
        namespace_label, pod_label, container_label = self.names
        labels = {namespace_label: namespace, pod_label: pod, container_label: container}
        if self.uid:
            labels["pod_uid"] = uid
        return labels


class GpuMetrics:
    """A scrape's series: what its refresh of the telemetry returned, with the snapshot and who holds each
    device, read at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        holders: Callable[[], Mapping[str, list[Holder]]],
        settings: Callable[[], TelemetryConfig],
        hostname: str,
    ) -> None:
        self._snapshot = snapshot
        self._holders = holders
        self._settings = settings
        self._hostname = hostname
        self._container_texts: dict[tuple[str, str, ProcessContainer, Holder | None], str] = {}
        self._texts_labelling = PodLabelling()  # how the kept texts name pods: a reload may change it

    def render(self, telemetry: Telemetry) -> bytes:
        """The series of what the scrape's refresh returned."""
        snap = self._snapshot()
        gpus = {g.uuid: g for g in snap.gpus}
        settings = self._settings()
        naming = settings.naming
        out = Families()
        holders = self._holders()
        # Who holds each device, for the device series' pod labels; none unless asked.
        labelled: Mapping[str, list[Holder]] = holders if settings.pod_labels else {}
        named_pods = _Pods(PodLabelling.of(settings), telemetry.pod_uids)
        for reading in telemetry.readings:
            gpu = gpus.get(reading.uuid)
            if gpu is None:
                continue
            labels = self._gpu_labels(gpu, snap, naming)
            text = label_text(labels)
            codes = snap.xid_codes.get(gpu.uuid, ())
            groups = _by_container(reading, telemetry)
            for copy, own in _held_copies(reading.uuid, None, text, groups, labelled, named_pods):
                self._figures(out, GPU_SERIES, reading.figures, copy, naming, own)
                if naming == "dcgm" and codes:
                    last = "DCGM_FI_DEV_XID_ERRORS"
                    out.add(last, "The last Xid's code", "gauge", last, copy, codes[-1][0])
            profiles = {m.uuid: m for m in gpu.mig}
            for mig in reading.mig:
                known = profiles.get(mig.uuid)
                if known is None:
                    continue
                extra = (
                    {"GPU_I_ID": str(known.gpu_instance), "GPU_I_PROFILE": known.profile}
                    if naming == "dcgm"
                    else {
                        "gpu_instance_id": str(known.gpu_instance),
                        "gpu_instance_profile": known.profile,
                        "mig_uuid": mig.uuid,
                    }
                )
                mig_text = label_text(labels | extra)
                for copy, own in _held_copies(mig.uuid, known, mig_text, groups, labelled, named_pods):
                    self._figures(out, MIG_SERIES, mig, copy, naming, own)
            self._xids(out, codes, text)
            stale = "nvplug_gpu_metrics_stale"
            out.add(
                stale,
                "1 while a GPU's figures are older than asked",
                "gauge",
                stale,
                text,
                1.0 if reading.stale else 0.0,
            )
            read_at = "nvplug_gpu_metrics_read_timestamp_seconds"
            out.add(read_at, "When the GPU's figures were read", "gauge", read_at, text, reading.read_at)
            # Of the GPU's labels only those the others join on: 2,000 series of a busy node stay small.
            joins: dict[str, str] = {k: v for k, v in labels.items() if k in JOIN_LABELS}
            self._containers(out, groups, joins, holders, profiles, named_pods.labelling)
        return out.text().encode()

    def _gpu_labels(self, gpu: Gpu, snap: Snapshot, naming: MetricNaming) -> dict[str, str]:
        device = f"nvidia{gpu.minor}" if gpu.minor is not None else ""
        if naming == "dcgm":
            return {
                "gpu": str(gpu.index),
                "UUID": gpu.uuid,
                "pci_bus_id": gpu.bus_id,
                "device": device,
                "modelName": gpu.name or "",
                "Hostname": self._hostname,
                "DCGM_FI_DRIVER_VERSION": snap.driver_version or "",
            }
        return {
            "gpu": str(gpu.index),
            "uuid": gpu.uuid,
            "pci_bus_id": gpu.bus_id,
            "device": device,
            "model": gpu.name or "",
            "hostname": self._hostname,
        }

    @staticmethod
    def _xids(out: Families, codes: tuple[tuple[int, int], ...], labels: str) -> None:
        """nvplug's own count of each Xid it took in (NVML's and the kernel log's once each), in both namings
        (dcgm's DCGM_FI_DEV_XID_ERRORS has only the last one's code)."""
        name = "nvplug_gpu_xid_errors"
        for code, count in sorted(codes):
            out.add(name, "Xids taken in, by code", "counter", f"{name}_total", f'{labels},code="{code}"', count)

    @staticmethod
    def _figures(
        out: Families,
        series: tuple[Series, ...],
        figures: object,
        labels: str,
        naming: MetricNaming,
        own: Mapping[str, float | None],
    ) -> None:
        """The figures' series; a figure in `own` (a holder's own share of the device) in place of the device's."""
        for s in series:
            value = own[s.figure] if s.figure in own else getattr(figures, s.figure, None)
            if value is None:
                continue  # the driver does not give it: no series, rather than a false 0
            if naming == "dcgm":
                # As dcgm-exporter's text shows them: every field a plain gauge, under its own name.
                if s.dcgm is not None:
                    out.add(s.dcgm, s.help, "gauge", s.dcgm, labels, float(value))
                continue
            if s.nvplug is None:
                continue
            sample = f"{s.nvplug}_total" if s.counter else s.nvplug
            extra = "".join(f',{k}="{v}"' for k, v in s.labels)
            kind = "counter" if s.counter else "gauge"
            out.add(s.nvplug, s.help, kind, sample, labels + extra, in_unit(float(value), s.scale))

    def _containers(
        self,
        out: Families,
        groups: Mapping[tuple[str, ProcessContainer], list[ProcessUse]],
        gpu_labels: dict[str, str],
        holders: Mapping[str, list[Holder]],
        migs: Mapping[str, MigDevice],
        labelling: PodLabelling,
    ) -> None:
        """Per container and device: its processes' memory and utilization, summed. Processes in no pod
        the kubelet names are counted under pod=""."""
        joins = label_text(gpu_labels)
        if labelling != self._texts_labelling:
            self._container_texts.clear()
            self._texts_labelling = labelling
        texts = self._container_texts
        (p_name, p_lines), (m_name, m_lines), (s_name, s_lines), (u_name, u_lines) = (
            (name, out.family(name, help_text, kind))
            for name, help_text, kind in (CONTAINER_PROCESSES, CONTAINER_MEMORY, CONTAINER_SM, CONTAINER_MEMORY_UTIL)
        )
        for (device, container), uses in groups.items():
            held = holders.get(device)
            claim = _claim_of(container, held) if held else None
            key = (joins, device, container, claim)
            labels = texts.get(key)
            if labels is None:
                if len(texts) >= CONTAINER_TEXTS:  # pods come and go: forget the old
                    texts.clear()
                named = _container_labels(device, container, claim, migs.get(device), labelling)
                labels = texts[key] = "{" + joins + "," + label_text(named) + "} "
            count, used_mib, sm, memory = _summed(uses)
            p_lines.append(f"{p_name}{labels}{float(count)!r}\n")
            if used_mib is not None:
                m_lines.append(f"{m_name}{labels}{used_mib * MIB!r}\n")
            if sm is not None:  # none on MIG: NVML gives no per-process utilization there
                s_lines.append(f"{s_name}{labels}{sm / 100.0!r}\n")
                u_lines.append(f"{u_name}{labels}{memory / 100.0!r}\n")


def telemetry_document(telemetry: Telemetry, snapshot: Snapshot) -> dict[str, object]:
    """/telemetry: each GPU's figures and health, and its processes with their containers (`nvplug top`)."""
    gpus = {g.uuid: g for g in snapshot.gpus}
    out = []
    for reading in telemetry.readings:
        gpu = gpus.get(reading.uuid)
        if gpu is None:
            continue
        health = snapshot.health.get(gpu.uuid)
        processes = []
        for use in reading.processes:
            where = telemetry.container_of(use.pid)
            processes.append(
                use._asdict() | {"namespace": where.namespace, "pod": where.pod, "container": where.container}
            )
        out.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "healthy": health is None or health.healthy,
                "reason": None if health is None or health.healthy else health.reason,
                "read_at": reading.read_at,
                "stale": reading.stale,
                "figures": dataclasses.asdict(reading.figures),
                "mig": [dataclasses.asdict(m) for m in reading.mig],
                "processes": processes,
            }
        )
    return {"gpus": out}


def _by_container(reading: GpuReading, telemetry: Telemetry) -> dict[tuple[str, ProcessContainer], list[ProcessUse]]:
    out: dict[tuple[str, ProcessContainer], list[ProcessUse]] = {}
    where = telemetry.containers  # not container_of: a call per process, hundreds a scrape
    for use in reading.processes:
        key = (use.device, where.get(use.pid, HOST))
        group = out.get(key)
        if group is None:
            out[key] = [use]
        else:
            group.append(use)
    return out


def _summed(uses: list[ProcessUse]) -> tuple[int, float | None, float | None, float]:
    """A container's processes on a device: how many, and their memory, SM and memory utilization summed;
    None where no process has the figure."""
    if len(uses) == 1:  # the usual case, so the cheap one
        use = uses[0]
        return 1, use.used_mib, use.sm_util, use.memory_util or 0.0
    used = [u.used_mib for u in uses if u.used_mib is not None]
    sampled = [(u.sm_util, u.memory_util or 0.0) for u in uses if u.sm_util is not None]
    return (
        len(uses),
        sum(used) if used else None,
        sum(sm for sm, _ in sampled) if sampled else None,
        sum(memory for _, memory in sampled),
    )


def _claim_of(container: ProcessContainer, holders: Sequence[Holder]) -> Holder | None:
    """The DRA claim through which the container holds the device, if it holds it through one."""
    return next((h for h in holders if h.claim is not None and _holds(h, container)), None)


def _container_labels(
    device: str, container: ProcessContainer, claim: Holder | None, mig: MigDevice | None, labelling: PodLabelling
) -> dict[str, str]:
    """The container's names (its pod's UID from its cgroup), the device it uses, and the DRA claim through
    which it holds it, if any."""
    labels = {"device_uuid": device} | labelling.labels(
        container.namespace, container.pod, container.container, container.pod_uid
    )
    return labels | (_claim_labels(claim, mig) if claim is not None else {})


def _claim_labels(claim: Holder, mig: MigDevice | None) -> dict[str, str]:
    """dcgm-exporter's DRA labels: the claim, and the MIG device it got, if a MIG device."""
    labels = {
        "dra_claim_name": claim.claim or "",
        "dra_claim_namespace": claim.namespace,
        "dra_driver_name": claim.resource,
        "dra_pool_name": claim.pool or "",
        "dra_device_name": claim.device_id,
    }
    if mig is not None:
        labels |= {"dra_mig_profile": mig.profile, "dra_mig_device_uuid": mig.uuid}
    return labels


@dataclass(frozen=True)
class _Pods:
    """A scrape's pod labelling, and the UIDs of the pods that hold devices (the kubelet's records)."""

    labelling: PodLabelling
    uids: Mapping[tuple[str, str], str]

    def of_holder(self, holder: Holder, mig: MigDevice | None) -> dict[str, str]:
        """dcgm-exporter's pod labels, and DRA's where the pod holds the device through a claim."""
        uid = self.uids.get((holder.namespace, holder.pod), "") if self.labelling.uid else ""
        labels = self.labelling.labels(holder.namespace, holder.pod, holder.container, uid)
        return labels | (_claim_labels(holder, mig) if holder.claim is not None else {})


def _held_copies(
    device: str,
    mig: MigDevice | None,
    text: str,
    groups: Mapping[tuple[str, ProcessContainer], list[ProcessUse]],
    holders: Mapping[str, list[Holder]],
    named_pods: _Pods,
) -> list[tuple[str, dict[str, float | None]]]:
    """A device's label text, once per container that holds it with that pod's labels (dcgm-exporter's
    --kubernetes), or once as is where none does; with the figures each copy shows as its own. Where several
    containers share the device, a copy's utilization and framebuffer used are its own processes', summed (0
    with none): the device's, copied to each, would count it once per pod in a sum."""
    holding = {(h.namespace, h.pod, h.container, h.claim): h for h in holders.get(device, ())}
    if len(holding) < 2:
        return [(f"{text},{label_text(named_pods.of_holder(h, mig))}", {}) for h in holding.values()] or [(text, {})]
    # The device's containers by pod: each holder looks up its own pod's, not every process.
    pods: dict[tuple[str, str], list[tuple[ProcessContainer, list[ProcessUse]]]] = {}
    for (on, container), uses in groups.items():
        if on == device:
            pods.setdefault((container.namespace, container.pod), []).append((container, uses))
    out = []
    for h in holding.values():
        held = [u for c, uses in pods.get((h.namespace, h.pod), ()) if _holds(h, c) for u in uses]
        _, used, sm, memory = _summed(held) if held else (0, 0.0, 0.0, 0.0)
        own = {"fb_used_mib": used, "util_gpu": sm, "util_memory": memory if sm is not None else None}
        out.append((f"{text},{label_text(named_pods.of_holder(h, mig))}", own))
    return out


def _holds(holder: Holder, container: ProcessContainer) -> bool:
    """The container is the holder's (a DRA claim's holder may name no container: then any of its pod's)."""
    same_pod = (container.namespace, container.pod) == (holder.namespace, holder.pod)
    return same_pod and holder.container in ("", container.container)
