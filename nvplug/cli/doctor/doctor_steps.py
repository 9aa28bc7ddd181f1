"""The steps of `nvplug doctor`, in the order they run and are numbered.

The failure chain from the kernel driver to the kubelet: each step may rely on what the
ones before it found (DoctorContext), and their texts refer to each other by number.
A new step is a module of its own beside these, and an entry here.
"""

from __future__ import annotations

from nvplug.cli.doctor import (
    cdi_names_step,
    config_valid_step,
    daemon_status_step,
    device_nodes_step,
    dra_service_step,
    kernel_driver_step,
    kubelet_socket_step,
    kubelet_view_step,
    mps_daemons_step,
    node_labels_step,
    nvml_init_step,
    nvml_library_step,
    plugin_dir_step,
)
from nvplug.cli.doctor.doctor_step import Step

STEPS: tuple[Step, ...] = (
    Step("kernel driver", kernel_driver_step.check_driver),
    Step(nvml_library_step.LIB_NAME, nvml_library_step.check_library),
    Step("NVML init", nvml_init_step.check_nvml),
    Step("device nodes", device_nodes_step.check_device_nodes),
    Step("device-plugin dir", plugin_dir_step.check_plugin_dir),
    Step("kubelet.sock", kubelet_socket_step.check_kubelet),
    Step("nvplug daemon", daemon_status_step.check_daemon),
    Step("config", config_valid_step.check_config),
    Step("CDI spec", cdi_names_step.check_cdi),
    Step("node labels", node_labels_step.check_labels),
    Step("kubelet's view", kubelet_view_step.check_kubelet_view),
    Step("DRA", dra_service_step.check_dra),
    Step("MPS", mps_daemons_step.check_mps),
)
