"""What Allocate will need of each device, checked at every scan.

A device that Allocate would refuse must never be advertised Healthy: the
kubelet would schedule pods onto it that then fail admission.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nvplug.core.gpu import Gpu
from nvplug.core.mig import MIG_MINORS, CapMinors


def unready(gpus: Iterable[Gpu], cap_minors: CapMinors, node_exists: Callable[[str], bool]) -> dict[str, str]:
    """Devices (GPU or MIG UUIDs) that Allocate could not hand out, and why.

    `node_exists` answers for a /dev path as the container will get it (under the dev root).
    """
    problems: dict[str, str] = {}
    for gpu in gpus:
        node = gpu.device_node
        if node is not None and not node_exists(node):
            problems[gpu.uuid] = f"its device node {node} is missing"
            continue
        if gpu.minor is None:
            continue
        for mig in gpu.mig:
            if cap_minors.nodes(gpu.minor, mig.gpu_instance, mig.compute_instance) is None:
                problems[mig.uuid] = (
                    f"no capability device minors listed for gpu {gpu.minor} gi {mig.gpu_instance} "
                    f"ci {mig.compute_instance} in /proc/{MIG_MINORS}"
                )
    return problems
