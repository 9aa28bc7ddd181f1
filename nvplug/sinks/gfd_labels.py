"""Node labels with GPU Feature Discovery's keys and value formats, from the node's state.

Pure: the snapshot, the config and two facts of the machine (its DMI product name and
the GPUs' PCI classes) go in; a dict of labels comes out. Where GFD's output is
undefined (two GPU models: a random one wins) or breaks Kubernetes' rules (values
over 63 characters), nvplug picks one defined answer; docs/labels.md lists each.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nvplug.config import GPU_RESOURCE, Config, ReplicatedResource
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.snapshot import Snapshot
from nvplug.shaping.resource_plan import Naming

PREFIX = "nvidia.com/"
# The optional health label (nvplug.labels.unhealthyCount): GFD has no such key.
UNHEALTHY_COUNT = f"{PREFIX}gpu.unhealthy-count"
# The snapshot's fields the labels are made of: the health of none, but for UNHEALTHY_COUNT.
LABEL_READS = frozenset({"gpus", "driver_version", "cuda_version"})
# PCI class codes of NVIDIA GPUs in sysfs: a VGA controller drives displays, a 3D controller computes.
PCI_CLASS_MODES = {0x030000: "graphics", 0x030200: "compute"}
# GFD's architecture names by compute capability major (7 and 8 split by minor).
FAMILIES = {
    1: "tesla",
    2: "fermi",
    3: "kepler",
    5: "maxwell",
    6: "pascal",
    9: "hopper",
    10: "blackwell",
    12: "blackwell",
    13: "rubin",
}
MAX_VALUE = 63
_NOT_IN_PRODUCT = re.compile(r"[^A-Za-z0-9\-_. ]")
_NOT_IN_VALUE = re.compile(r"[^A-Za-z0-9\-_.]")


@dataclass(frozen=True)
class Machine:
    """What the labels need beyond NVML: the DMI product name, and the PCI class of each GPU by bus id."""

    product_name: str | None = None
    pci_classes: Mapping[str, int] = field(default_factory=dict)


def node_labels(snap: Snapshot, cfg: Config, machine: Machine, unhealthy_count: bool = False) -> dict[str, str]:
    """Every label, keys with the nvidia.com/ prefix; none at all on a node without GPUs (as GFD)."""
    if not snap.gpus:
        return {}
    labels = {f"{PREFIX}gpu.machine": _machine(machine.product_name)}
    labels.update(_versions(snap))
    labels[f"{PREFIX}mig.capable"] = _bool(any(g.mig_capable for g in snap.gpus))
    # As GFD: whether the config shares devices through MPS (nvplug runs its daemons).
    labels[f"{PREFIX}mps.capable"] = _bool(cfg.sharing.strategy == "mps")
    # GFD writes it on bare metal too (v0.20: false without a vGPU host driver); nvplug runs there only.
    labels[f"{PREFIX}vgpu.present"] = "false"
    labels.update(_gpu_labels(snap.gpus, cfg))
    strategy = cfg.flags.mig_strategy
    if strategy != "none":
        labels[f"{PREFIX}mig.strategy"] = strategy
        labels.update(_single(snap.gpus, cfg) if strategy == "single" else _mixed(snap.gpus, cfg))
    labels[f"{PREFIX}gpu.mode"] = _mode(snap.gpus, machine.pci_classes)
    if unhealthy_count:
        labels[UNHEALTHY_COUNT] = str(len(snap.unhealthy()))
    return {key: _valid_value(value) for key, value in labels.items()}


def render(labels: Mapping[str, str]) -> bytes:
    """NFD's feature file: one key=value line each, sorted, with no timestamp (nothing changes for nothing)."""
    lines = ["# GPU labels written by nvplug (GPU Feature Discovery's keys); rewritten when they change."]
    lines += [f"{key}={value}" for key, value in sorted(labels.items())]
    return ("\n".join(lines) + "\n").encode()


def model_gpus(gpus: Sequence[Gpu]) -> list[Gpu]:
    """The GPUs the gpu.* labels describe: the most numerous model, ties to the one at the lowest index.

    GFD lets a random model win on a mixed node, and its labels can flap between runs.
    """
    counts = Counter(g.name for g in gpus)
    first = {name: min(g.index for g in gpus if g.name == name) for name in counts}
    name = min(counts, key=lambda n: (-counts[n], first[n]))
    return [g for g in gpus if g.name == name]


def _gpu_labels(gpus: Sequence[Gpu], cfg: Config) -> dict[str, str]:
    model = model_gpus(gpus)
    gpu = model[0]
    # Sharing never applies to a GPU in MIG mode: when every GPU of the model is, it is not shared.
    whole = not all(g.mig_enabled for g in model)
    entry = _sharing(cfg, Naming.from_config(cfg).gpu_name(gpu)) if whole else None
    labels = _base("gpu", _product(gpu.name), len(model), entry, sharing_on=whole)
    if gpu.memory_mib:
        labels[f"{PREFIX}gpu.memory"] = str(gpu.memory_mib)
    cc = gpu.compute_capability
    if cc is not None and cc[0] != 0:
        labels[f"{PREFIX}gpu.family"] = _family(*cc)
        labels[f"{PREFIX}gpu.compute.major"] = str(cc[0])
        labels[f"{PREFIX}gpu.compute.minor"] = str(cc[1])
    return labels


def _single(gpus: Sequence[Gpu], cfg: Config) -> dict[str, str]:
    """MIG devices offered as nvidia.com/gpu: the gpu.* labels describe them, or say the layout is invalid."""
    on = [g for g in gpus if g.mig_enabled]
    if not on:
        return {}
    migs = [(g, m) for g in on for m in g.mig]
    profiles = {m.profile for _, m in migs}
    if len(on) != len(gpus) or len(profiles) != 1 or any(not g.mig for g in on):
        product = f"{_product(on[0].name)}-MIG-INVALID"
        return {
            f"{PREFIX}gpu.product": product,
            f"{PREFIX}gpu.count": "0",
            f"{PREFIX}gpu.replicas": "0",
            f"{PREFIX}gpu.memory": "0",
        }
    parent, mig = migs[0]
    entry = _sharing(cfg, Naming.from_config(cfg).name(parent, mig) or GPU_RESOURCE)
    labels = _base("gpu", f"{_product(parent.name)}-MIG-{mig.profile}", len(migs), entry, sharing_on=True)
    return labels | _attributes("gpu", mig)


def _mixed(gpus: Sequence[Gpu], cfg: Config) -> dict[str, str]:
    """One set of mig-<profile>.* labels per profile present."""
    by_profile: dict[str, list[tuple[Gpu, MigDevice]]] = {}
    for g in gpus:
        if g.mig_enabled:
            for m in g.mig:
                by_profile.setdefault(m.profile, []).append((g, m))
    labels: dict[str, str] = {}
    for profile, migs in sorted(by_profile.items()):
        parent, mig = migs[0]
        stem = f"mig-{profile}"
        entry = _sharing(cfg, f"{PREFIX}{stem}")
        labels |= _base(stem, f"{_product(parent.name)}-MIG-{profile}", len(migs), entry, sharing_on=True)
        labels |= _attributes(stem, mig)
    return labels


def _base(
    stem: str, product: str, count: int, sharing: tuple[ReplicatedResource, str] | None, sharing_on: bool
) -> dict[str, str]:
    """product, count, replicas and sharing-strategy, as GFD's base labeler writes them; `sharing`:
    the sharing entry of the resource and its strategy (time-slicing, mps)."""
    entry, strategy = sharing if sharing is not None else (None, "none")
    replicas = entry.replicas if entry is not None else (1 if sharing_on else 0)
    shared = entry is not None and replicas > 1
    if shared and entry is not None and entry.rename is None:
        product += "-SHARED"  # a renamed resource says it is shared by its name
    return {
        f"{PREFIX}{stem}.product": product,
        f"{PREFIX}{stem}.count": str(count),
        f"{PREFIX}{stem}.replicas": str(replicas),
        f"{PREFIX}{stem}.sharing-strategy": strategy if shared else "none",
    }


def _attributes(stem: str, mig: MigDevice) -> dict[str, str]:
    a = mig.attributes
    values: dict[str, int | None] = {"memory": mig.memory_mib}
    if a is not None:
        values |= {
            "multiprocessors": a.multiprocessors,
            "slices.gi": a.gi_slices,
            "slices.ci": a.ci_slices,
            "engines.copy": a.copy_engines,
            "engines.decoder": a.decoders,
            "engines.encoder": a.encoders,
            "engines.jpeg": a.jpeg_engines,
            "engines.ofa": a.ofa_engines,
        }
    return {f"{PREFIX}{stem}.{k}": str(v) for k, v in values.items() if v is not None}


def _sharing(cfg: Config, resource: str) -> tuple[ReplicatedResource, str] | None:
    """The sharing entry for a resource and its strategy, if the config has one."""
    found = next((r for r in cfg.sharing.replicated.resources if r.name == resource), None)
    return (found, cfg.sharing.strategy) if found is not None else None


def _versions(snap: Snapshot) -> dict[str, str]:
    labels: dict[str, str] = {}
    parts = (snap.driver_version or "").split(".")
    if snap.driver_version and 2 <= len(parts) <= 3:
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        for stem, rev_key in (("cuda.driver-version", "revision"), ("cuda.driver", "rev")):
            labels |= {f"{PREFIX}{stem}.major": major, f"{PREFIX}{stem}.minor": minor, f"{PREFIX}{stem}.{rev_key}": rev}
        labels[f"{PREFIX}cuda.driver-version.full"] = snap.driver_version
    if snap.cuda_version:
        # GFD's "runtime" labels hold the CUDA version the driver supports.
        major_c, minor_c = snap.cuda_version // 1000, (snap.cuda_version % 1000) // 10
        for stem in ("cuda.runtime-version", "cuda.runtime"):
            labels |= {f"{PREFIX}{stem}.major": str(major_c), f"{PREFIX}{stem}.minor": str(minor_c)}
        labels[f"{PREFIX}cuda.runtime-version.full"] = f"{major_c}.{minor_c}"
    return labels


def _family(major: int, minor: int) -> str:
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return FAMILIES.get(major, "undefined")


def _mode(gpus: Sequence[Gpu], classes: Mapping[str, int]) -> str:
    modes = {PCI_CLASS_MODES.get(classes.get(g.bus_id, -1), "unknown") for g in gpus}
    return modes.pop() if len(modes) == 1 else "unknown"


def _product(name: str | None) -> str:
    """GFD's sanitising: characters outside [A-Za-z0-9-_. ] dropped, runs of spaces one `-`."""
    return "-".join(_NOT_IN_PRODUCT.sub("", name or "unknown").split()) or "unknown"


def _machine(product_name: str | None) -> str:
    if product_name is None:
        return "unknown"
    return product_name.strip().replace(" ", "-")


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _valid_value(value: str) -> str:
    """A value Kubernetes accepts (NFD drops a label whose value it would refuse): characters outside
    [A-Za-z0-9-_.] dropped, at most 63, alphanumeric at both ends. GFD's own values are unchanged by this."""
    cleaned = _NOT_IN_VALUE.sub("", value)[:MAX_VALUE]
    return cleaned.strip("-_.")
