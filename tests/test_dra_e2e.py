"""DRA end to end: the daemon's DRA kubelet plugin, registered through plugins_registry with the
kubelet's DRA stand-in, publishing ResourceSlices to the API-server stand-in over HTTP, and
preparing claims; restarts of each, health changes and hot adds; the device plugin beside it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import podman
from support.admission_policies import User, node_user
from support.apiserver_standin import FakeApiServer
from support.dra_kubelet_standin import DraKubelet
from support.scraped_metrics import value
from test_cdi_podman import (
    CHAR,
    NVIDIA_MAJOR,
    check_driver_files,
    expected_control_nodes,
    read_spec,
    real_device_nodes,
    run_inside,
)
from test_devices import devices
from test_doctor import doctor
from test_mig_e2e import mig_node
from test_telemetry import scrape_later

from nvplug.cdi.cdi_spec import GPU_KIND
from nvplug.status import status_client as statusclient
from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing.fakenvml_devices import GpuProcess
from nvplug.testing.pod_cgroups import CgroupsUnavailable, PodCgroups
from nvplug.testing.podresources_standin import ClaimDevice, Container, Pod
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0
DRIVER = "gpu.nvidia.com"
NODE = "node-a"
# The dedicated per-node identity's RBAC and ValidatingAdmissionPolicy, as shipped.
NODE_IDENTITY_MANIFEST = Path(__file__).resolve().parent.parent / "packaging/kubernetes/nvplug-node-identity.yaml"


@dataclass
class Dra:
    node: SimulatedNode
    api: FakeApiServer
    kubelet: DraKubelet
    kubeconfig: Path

    def config(self, devices: str = "[4, 5, 6, 7]", extra: str = "") -> str:
        return f"""version: v1
flags:
  plugin:
    deviceListStrategy: [cdi-cri]
{extra}nvplug:
  dra:
    enabled: true
    nodeName: {NODE}
    kubeconfig: {self.kubeconfig}
    devices: {devices}
    registryDir: {self.node.root / "registry"}
    pluginsDir: {self.node.root / "plugins"}
"""

    def start(self, cfg: str | None = None) -> None:
        self.node.config.write_text(cfg or self.config())
        self.node.kubelet.start()
        self.node.start_daemon()
        self.kubelet.start()
        self.wait(lambda: self.kubelet.plugin(DRIVER) is not None, "the DRA plugin's registration")

    def slices(self) -> list[dict[str, Any]]:
        return self.api.slices(node=NODE, driver=DRIVER)

    def pool(self) -> dict[str, dict[str, Any]]:
        """The published devices by name (v1 shape: attributes on the device)."""
        return {d["name"]: d for s in self.slices() for d in s["spec"]["devices"]}

    def wait(self, check: Callable[[], bool], what: str) -> float:
        began = time.monotonic()
        while time.monotonic() - began < TIMEOUT:
            if check():
                return time.monotonic() - began
            time.sleep(0.005)
        raise AssertionError(f"timed out waiting for {what}; slices: {json.dumps(self.slices(), indent=1)}\n"
                             f"daemon log:\n{self.node.log_text()[-3000:]}")  # fmt: skip

    def claim(self, name: str, *devices: str, request: str = "gpu") -> tuple[str, str, str]:
        """An allocated ResourceClaim of these devices of the node's pool; (namespace, name, uid)."""
        uid = f"uid-{name}"
        results = [{"request": request, "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
        self.api.add_claim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "ml", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": request}]}},
            "status": {"allocation": {"devices": {"results": results}}},
        })  # fmt: skip
        return ("ml", name, uid)


def serving(node: SimulatedNode, api: FakeApiServer, kubelet: DraKubelet) -> Iterator[Dra]:
    """The stand-ins and the node as a Dra, stopped after (the API server started already)."""
    try:
        yield Dra(node, api, kubelet, api.write_kubeconfig(node.root / "kubeconfig"))
    finally:
        kubelet.stop()
        node.stop_daemon()
        api.stop()


def serving_136(node: SimulatedNode) -> Iterator[Dra]:
    """A 1.36 control plane and kubelet (taints kept, resource health watched) serving the node."""
    api = FakeApiServer(versions=("v1",), netns=node.netns)
    api.start()
    yield from serving(node, api, DraKubelet(node.root / "registry", NODE, "1.36", api))


@pytest.fixture
def dra(node: SimulatedNode) -> Iterator[Dra]:
    # A 1.34 control plane: DRADeviceTaints is alpha and off, so an Unhealthy device leaves the pool.
    api = FakeApiServer(versions=("v1", "v1beta1"), taints=False, netns=node.netns)
    api.start()
    yield from serving(node, api, DraKubelet(node.root / "registry", NODE, "1.34", api))


def test_slices_prepare_and_the_device_plugin_beside_it(dra: Dra) -> None:
    dra.start()
    uuids = [g["uuid"] for g in dra.node.scenario_gpus()]
    # The device plugin keeps GPUs 0-3; DRA offers 4-7: no GPU through both.
    dra.node.kubelet.wait_for(registered_with(4, GPU_RESOURCE), TIMEOUT)
    plugin = dra.node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and sorted(plugin.devices) == sorted(uuids[:4])
    dra.wait(lambda: len(dra.pool()) == 4, "four devices in the pool")
    registration = dra.kubelet.plugin(DRIVER)
    assert registration is not None and registration.service == "v1.DRAPlugin"
    assert registration.endpoint == str(dra.node.root / "plugins" / DRIVER / "dra.sock")
    (published,) = dra.slices()
    print(json.dumps(published, indent=1))
    spec = published["spec"]
    assert spec["pool"] == {"name": NODE, "generation": spec["pool"]["generation"], "resourceSliceCount": 1}
    gpu5 = dra.pool()["gpu-5"]
    assert gpu5["attributes"]["type"] == {"string": "gpu"} and gpu5["attributes"]["uuid"] == {"string": uuids[5]}
    assert gpu5["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert gpu5["attributes"]["architecture"] == {"string": "Hopper"}
    assert gpu5["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert gpu5["attributes"]["driverVersion"] == {"version": "550.54.15"}
    assert gpu5["attributes"]["cudaDriverVersion"] == {"version": "12.4.0"}
    assert gpu5["attributes"]["index"] == {"int": 5} and gpu5["attributes"]["minor"] == {"int": 5}
    assert gpu5["attributes"]["pcieBusID"] == {"string": "0000:ab:00.0"}
    assert gpu5["capacity"]["memory"] == {"value": "81559Mi"}

    claim = dra.claim("train", "gpu-5")
    (answer,) = dra.kubelet.prepare(DRIVER, [claim]).values()
    assert answer.error == ""
    assert answer.devices == ((NODE, "gpu-5", ("gpu",), (f"{GPU_KIND}={uuids[5]}",)),)
    # Idempotent: asked again, the same answer.
    assert dra.kubelet.prepare(DRIVER, [claim]) == {claim[2]: answer}
    status = status_of(dra.node)
    assert status["dra"]["claims"] == [{"namespace": "ml", "name": "train", "uid": claim[2], "devices": ["gpu-5"],
                                        "cdi": [f"{GPU_KIND}={uuids[5]}"], "mps_group": None}]  # fmt: skip
    # The operator's view: which GPUs DRA offers, and the claims that hold them.
    rc, text, err = devices(dra.node, listen=f"unix:{dra.node.status_socket}")
    print(text)
    assert rc == 0, err
    assert "DRA gpu.nvidia.com: registered, 4 devices in the pool (ResourceSlices: node-a-gpu.nvidia.com-" in text
    assert "1 claims prepared" in text
    assert "advertised: through DRA: gpu.nvidia.com gpu-5, claimed by ml/train" in text
    assert "advertised: through DRA: gpu.nvidia.com gpu-4, in the pool" in text
    assert f"advertised: nvidia.com/gpu {uuids[0]}" in text
    metrics = statusclient.fetch(f"unix:{dra.node.status_socket}", "/metrics")[1]
    assert 'nvplug_dra_claims_prepared{driver="gpu.nvidia.com"} 1.0' in metrics
    assert 'nvplug_dra_pool_devices{driver="gpu.nvidia.com"} 4.0' in metrics
    # Per-claim errors: an unknown device, a claim the API server does not have, one of another UID.
    bogus = dra.claim("bogus", "gpu-0")
    missing = ("ml", "gone", "uid-gone")
    results = dra.kubelet.prepare(DRIVER, [bogus, missing, ("ml", "train", "uid-other")])
    assert "device gpu-0 is not offered by gpu.nvidia.com on node-a (unknown device)" in results[bogus[2]].error
    assert "cannot read the claim from the API server: not found" in results["uid-gone"].error
    assert "the API server has UID uid-train under that name" in results["uid-other"].error
    assert dra.kubelet.unprepare(DRIVER, [claim, missing]) == {claim[2]: "", "uid-gone": ""}
    assert status_of(dra.node)["dra"]["claims"] == []


def test_health_changes_and_hot_adds_reach_the_slices_within_milliseconds(dra: Dra) -> None:
    dra.start(dra.config(devices="[]"))  # every GPU to DRA
    dra.wait(lambda: len(dra.pool()) == 8, "eight devices")
    claim = dra.claim("held", "gpu-6")
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]].error == ""
    began = time.monotonic()
    dra.node.control.xid(6, 79)
    dra.wait(lambda: "gpu-6" not in dra.pool(), "gpu-6 to leave the pool")
    print(f"XID 79 on GPU 6 -> ResourceSlice without gpu-6: {(time.monotonic() - began) * 1000:.1f} ms")
    print(json.dumps(dra.slices(), indent=1))
    # A new claim of the Unhealthy device fails alone; the prepared one stays prepared.
    late = dra.claim("late", "gpu-6")
    errors = dra.kubelet.prepare(DRIVER, [late, claim])
    assert "device gpu-6" in errors[late[2]].error and "is Unhealthy: XID 79" in errors[late[2]].error
    assert errors[claim[2]].error == ""
    if os.geteuid() == 0:
        new = "GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"
        dra.node.add_gpu(
            f'uuid={new} name="NVIDIA H100 80GB HBM3" minor=8 bus=0000:CC:00.0 numa=1 memory_mib=81559 cc=9.0'
        )
        began = time.monotonic()
        dra.node.send_uevent(pci_event("add", "0000:cc:00.0"))
        dra.node.send_uevent(pci_event("bind", "0000:cc:00.0", driver="nvidia"))
        dra.wait(lambda: "gpu-8" in dra.pool(), "the hot-added GPU in the pool")
        print(f"hot add -> ResourceSlice with gpu-8: {(time.monotonic() - began) * 1000:.1f} ms")
        assert dra.pool()["gpu-8"]["attributes"]["uuid"] == {"string": new}


def test_the_extended_resource_switch_serves_nvidia_com_gpu_pods_through_dra(dra: Dra) -> None:
    # nvplug.dra.extendedResources: the device plugin registers nvidia.com/gpu with no devices (allocatable 0,
    # which the scheduler needs before it backs the name with DRA), and the pool holds every GPU.
    dra.start(dra.config(devices="[]") + "    extendedResources: [nvidia.com/gpu]\n")
    dra.node.kubelet.wait_for(registered_with(0, GPU_RESOURCE), TIMEOUT)
    dra.wait(lambda: len(dra.pool()) == 8, "every GPU in the pool")
    plugin = dra.node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.devices == {}
    # A claim shaped as the scheduler makes one for `nvidia.com/gpu: 1`.
    uid = "uid-ext"
    name = "trainer-0-extended-resources-x7k2p"
    result = {"request": "container-0-request-0", "driver": DRIVER, "pool": NODE, "device": "gpu-3"}
    dra.api.add_claim({
        "metadata": {"namespace": "ml", "name": name, "uid": uid,
                     "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "trainer-0", "uid": "pod-1",
                                          "controller": True}]},
        "spec": {"devices": {"requests": [{"name": "container-0-request-0",
                                           "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {"allocation": {"devices": {"results": [result]}},
                   "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "pod-1"}]},
    })  # fmt: skip
    answer = dra.kubelet.prepare(DRIVER, [("ml", name, uid)])[uid]
    print(f"prepared {name}: {answer}")
    uuid = dra.node.scenario_gpus()[3]["uuid"]
    assert answer.error == "" and answer.devices == (
        (NODE, "gpu-3", ("container-0-request-0",), (f"k8s.device-plugin.nvidia.com/gpu={uuid}",)),
    )


def offered_through_time(dra: Dra, since: float) -> list[tuple[float, str, frozenset[str], frozenset[str]]]:
    """(when, what, GPUs the kubelet holds as allocatable nvidia.com/gpu, GPUs in the stored slices) at each
    change either stand-in saw after `since`: the kubelet's from ListAndWatch (a stream's end leaves its
    devices Unhealthy), the API server's from its writes."""
    by_minor = {f"gpu-{g['minor']}": g["uuid"] for g in dra.node.scenario_gpus()}
    views = dra.node.kubelet.views(GPU_RESOURCE)
    changes: list[tuple[float, str, Any]] = [
        (u.at, "kubelet", frozenset(u.healthy_ids)) for v in views for u in v.updates
    ]
    changes += [(v.stream_ended_at, "kubelet", frozenset()) for v in views if v.stream_ended_at is not None]
    changes += [(at, "api", (kind, name, names)) for at, kind, name, names in list(dra.api.timeline)]
    dp: frozenset[str] = frozenset()
    slices_now: dict[str, tuple[str, ...]] = {}
    out = []
    for at, who, what in sorted(changes, key=lambda c: c[0]):
        if who == "kubelet":
            dp = what
        else:
            kind, name, names = what
            if kind == "DELETED":
                slices_now.pop(name, None)
            else:
                slices_now[name] = names
        pool = frozenset(by_minor[n] for names in slices_now.values() for n in names)
        if at >= since:
            out.append((at, who, dp, pool))
    return out


def test_a_reload_that_moves_gpus_between_the_device_plugin_and_dra_never_offers_one_twice(dra: Dra) -> None:
    dra.start()  # DRA has 4-7, the device plugin 0-3
    uuids = [g["uuid"] for g in dra.node.scenario_gpus()]
    dra.node.kubelet.wait_for(registered_with(4, GPU_RESOURCE), TIMEOUT)
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    assert dra.node.daemon is not None
    began = time.monotonic()
    # 2 and 3 go to DRA, 6 and 7 to the device plugin.
    dra.node.config.write_text(dra.config(devices="[2, 3, 4, 5]"))
    dra.node.daemon.send_signal(signal.SIGHUP)
    dra.node.wait_log("reload moves 4 GPUs between the device plugin and DRA", TIMEOUT)
    dra.wait(lambda: sorted(dra.pool()) == ["gpu-2", "gpu-3", "gpu-4", "gpu-5"], "the new pool")

    def plugin_has(ids: set[str]) -> bool:
        plugin = dra.node.kubelet.plugin(GPU_RESOURCE)
        return plugin is not None and set(plugin.healthy_ids) == ids

    dra.wait(lambda: plugin_has({uuids[i] for i in (0, 1, 6, 7)}), "the device plugin's new list")
    timeline = offered_through_time(dra, began)
    print("through the reload (ms after SIGHUP: who saw a change; device plugin, DRA, both):")
    for at, who, dp, pool in timeline:
        print(f"  {(at - began) * 1000:8.1f}  {who:7}  {len(dp)} {len(pool)} {len(dp & pool)}")
    assert timeline and all(not (dp & pool) for _, _, dp, pool in timeline)
    # Every GPU is offered by one side at the end, none lost.
    _, _, dp, pool = timeline[-1]
    assert dp | pool == set(uuids) and len(dp) == len(pool) == 4
    # Anything else of nvplug.dra takes a restart: a reload that changes it is refused, the config stays.
    dra.node.config.write_text(dra.config(devices="[2, 3, 4, 5]").replace(f"nodeName: {NODE}", "nodeName: node-b"))
    dra.node.daemon.send_signal(signal.SIGHUP)
    line = dra.node.wait_log("reload refused", TIMEOUT)
    assert "nvplug.dra.nodeName changed; beyond devices, extendedResources and taintEffect that takes" in line
    assert sorted(dra.pool()) == ["gpu-2", "gpu-3", "gpu-4", "gpu-5"]
    # A GPU in use does not change sides: the other side would hand it out again while its pod runs.
    held = dra.claim("held", "gpu-5")
    dra.api._claims[("ml", "held")]["status"]["reservedFor"] = [{"resource": "pods", "name": "job-0", "uid": "p"}]
    assert dra.kubelet.prepare(DRIVER, [held])[held[2]].error == ""
    dra.node.config.write_text(dra.config(devices="[2, 3, 4]"))
    dra.node.daemon.send_signal(signal.SIGHUP)
    log = dra.node.wait_log("the reload would move gpu 5", TIMEOUT)
    line = next(ln for ln in log.splitlines() if "the reload would move gpu 5" in ln)
    print(line)
    assert "ml/job-0 (claim held)" in line and "drain it first" in line and "gpu-5" in dra.pool()


def test_a_claims_opaque_config_is_read_and_a_bad_one_fails_that_claim_alone(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    plain = dra.claim("plain", "gpu-4")
    mps = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
           "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}}}  # fmt: skip
    dra.api.add_claim({
        "metadata": {"namespace": "ml", "name": "shared", "uid": "uid-shared"},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-5"}],
            "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": mps}}],
        }}},
    })  # fmt: skip
    answers = dra.kubelet.prepare(DRIVER, [plain, ("ml", "shared", "uid-shared")])
    print(f"the claim with a bad mpsConfig: {answers['uid-shared'].error}")
    assert answers[plain[2]].error == ""
    assert ("ResourceClaim ml/shared (uid-shared): request gpu: config[0] (the claim): sharing.mpsConfig."
            "defaultActiveThreadPercentage: 150 is not between 0 and 100") in answers["uid-shared"].error  # fmt: skip


def test_a_reload_that_excludes_a_gpu_takes_it_out_of_the_pool(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    assert dra.node.daemon is not None
    dra.node.config.write_text(dra.config() + "  devices:\n    exclude: [5]\n")
    dra.node.daemon.send_signal(signal.SIGHUP)
    dra.wait(lambda: sorted(dra.pool()) == ["gpu-4", "gpu-6", "gpu-7"], "gpu-5 out of the pool")
    claim = dra.claim("late", "gpu-5")
    assert "unknown device" in dra.kubelet.prepare(DRIVER, [claim])[claim[2]].error


def test_restarts_of_the_kubelet_the_api_server_and_nvplug(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    claim = dra.claim("train", "gpu-4")
    first = dra.kubelet.prepare(DRIVER, [claim])[claim[2]]
    # The kubelet restarts: it deletes the node's slices, finds our socket again, and we publish again.
    dra.kubelet.restart()
    assert dra.kubelet.wiped >= 1
    # The watch writes them back as soon as they are gone, maybe before the kubelet registered us again.
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) == 2, "the registration with the restarted kubelet")
    dra.wait(lambda: len(dra.pool()) == 4, "the slices published again after the kubelet's restart")
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]] == first
    # The API server goes away: the device plugin does not notice, the slices catch up when it is back.
    dra.api.stop()
    dra.node.control.xid(5, 79)
    time.sleep(0.3)
    assert dra.node.daemon is not None and dra.node.daemon.poll() is None
    dra.node.wait_log("ResourceSlices of node-a not published", TIMEOUT)
    dra.api.restart()
    dra.wait(lambda: set(dra.pool()) == {"gpu-4", "gpu-6", "gpu-7"}, "the pool without gpu-5, once the API is back")
    # nvplug restarts: the prepared claim comes from its checkpoint, even with the claim deleted.
    assert dra.node.stop_daemon() == 0
    dra.api.delete_claim("ml", "train")
    dra.node.start_daemon()
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) >= 3, "registration of the restarted daemon")
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]] == first
    assert dra.kubelet.unprepare(DRIVER, [claim]) == {claim[2]: ""}
    assert dra.kubelet.unprepare(DRIVER, [claim]) == {claim[2]: ""}  # and again: idempotent


def test_a_kubelet_1_32_and_a_v1beta1_api_server(dra: Dra) -> None:
    dra.api.restart(keep_state=False)
    dra.api.versions = ("v1beta1",)
    dra.kubelet.version = "1.32"
    dra.start()
    dra.wait(lambda: bool(dra.slices()), "the slices")
    (published,) = dra.slices()
    assert published["apiVersion"] == "resource.k8s.io/v1beta1"
    assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert published["spec"]["devices"][0]["basic"]["attributes"]["type"] == {"string": "gpu"}
    registration = dra.kubelet.plugin(DRIVER)
    assert registration is not None and registration.service == "v1beta1.DRAPlugin"
    claim = dra.claim("old", "gpu-7")
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]].devices[0][1] == "gpu-7"


def test_a_mig_device_claim(dra: Dra) -> None:
    gpus = mig_node(dra.node, "mixed", {4: ["3g.40gb", "3g.40gb"]}, start=False)
    dra.start(dra.config(extra="  migStrategy: mixed\n") + "  telemetry:\n    podLabels: true\n")
    dra.wait(lambda: len(dra.pool()) == 5, "3 GPUs and 2 MIG devices")
    names = sorted(dra.pool())
    assert names == ["gpu-4-mig-3g40gb-1-0", "gpu-4-mig-3g40gb-2-0", "gpu-5", "gpu-6", "gpu-7"]
    mig = dra.pool()["gpu-4-mig-3g40gb-2-0"]
    print(json.dumps(mig, indent=1))
    assert mig["attributes"]["type"] == {"string": "mig"} and mig["attributes"]["profile"] == {"string": "3g.40gb"}
    assert mig["attributes"]["parentUUID"] == {"string": gpus[4]["uuid"]}
    claim = dra.claim("small", "gpu-4-mig-3g40gb-2-0", request="mig")
    (answer,) = dra.kubelet.prepare(DRIVER, [claim]).values()
    uuid = mig["attributes"]["uuid"]["string"]
    assert answer.error == "" and answer.devices == ((NODE, "gpu-4-mig-3g40gb-2-0", ("mig",), (f"{GPU_KIND}={uuid}",)),)
    print(f"prepare of a MIG device: {answer}")
    # Its pod's process on the MIG device: the container's series and the device's name the claim.
    try:
        cgroups = PodCgroups(dra.node.pod_log_root)
    except CgroupsUnavailable as err:
        pytest.skip(f"the MIG claim's telemetry: {err}")
    try:
        process = cgroups.start("ml", "small-0")
        device = ClaimDevice("ml", "small", DRIVER, NODE, "gpu-4-mig-3g40gb-2-0")
        dra.node.kubelet.pod_resources.admit(Pod("ml", "small-0", (Container("main", {}, (device,)),)))
        dra.node.control.procs(4, [GpuProcess(process.pid, 3000, mig=(2, 0))])
        got = scrape_later(dra.node)
    finally:
        cgroups.close()
    claimed = {"pod": "small-0", "container": "main", "dra_claim_name": "small", "dra_driver_name": DRIVER}
    claimed |= {"dra_pool_name": NODE, "dra_device_name": "gpu-4-mig-3g40gb-2-0", "dra_mig_device_uuid": uuid}
    assert value(got, "nvplug_container_gpu_memory_used_bytes", dra_mig_profile="3g.40gb", **claimed) == 3000 << 20
    assert value(got, "DCGM_FI_DEV_FB_USED", GPU_I_ID="2", **claimed) == 3000, got["DCGM_FI_DEV_FB_USED"]


def test_doctor_checks_registration_credentials_and_slices(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    claim = dra.claim("train", "gpu-5")
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]].error == ""
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    print(d.out)
    # A cluster admin's token: in service, and a warning that it may write any node's slices.
    assert d.verdict(12) == "WARN", d
    assert "12. DRA: DRA gpu.nvidia.com: registered, 4 devices published, 1 claims prepared; its credentials" in d.out
    assert f"{dra.api.url}: resource.k8s.io/v1, 1 ResourceSlices of node-a for gpu.nvidia.com" in d.text(12)
    assert (
        "these credentials may write other nodes' ResourceSlices: a dry run (which stores nothing) of one for "
        "node nvplug-doctor-no-such-node was accepted"
    ) in d.text(12)
    assert "nvplug.dra.kubeconfig: kubelet" in d.text(12)
    # The node's own identity (the Node authorizer's rules), and a dedicated one held by the shipped
    # ValidatingAdmissionPolicy: no warning, and the refusal as evidence.
    dra.api.users["node-a-token"] = node_user(NODE)
    dra.api.users["nvplug-a-token"] = User(f"nvplug:node:{NODE}", ("nvplug:nodes", "system:authenticated"))
    dra.api.admission.load(NODE_IDENTITY_MANIFEST)
    admin = dra.kubeconfig.read_text()
    for token, refusal in (
        ("node-a-token", 'User "system:node:node-a" cannot create resource "resourceslices"'),
        ("nvplug-a-token", "a member of nvplug:nodes may write only the ResourceSlices of the node in its user name"),
    ):
        dra.api.write_kubeconfig(dra.kubeconfig, token=token)
        d = doctor(dra.node, f"unix:{dra.node.status_socket}")
        print(d.text(12))
        assert d.verdict(12) == "PASS", d
        assert "another node's ResourceSlice is refused to these credentials" in d.text(12) and refusal in d.text(12)
    dra.kubeconfig.write_text(admin)
    # Credentials the API server refuses: a FAIL that says so.
    dra.api.token = "another-token"
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    assert d.verdict(12) == "FAIL" and "401" in d.text(12), d
    # Our registration socket removed (a cleanup, a careless operator): served again, registered again.
    dra.api.token = "test-token"
    (dra.node.root / "registry" / f"{DRIVER}-reg.sock").unlink()
    dra.node.wait_log("reg.sock was removed: serving it again", TIMEOUT)
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) == 2, "registration through the new socket")
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    assert d.verdict(12) == "WARN" and "registered, 4 devices published" in d.text(12), d


def test_a_bad_kubeconfig_leaves_the_device_plugin_alone(dra: Dra) -> None:
    dra.kubeconfig.write_text("apiVersion: v1\nclusters: []\n")
    dra.start()
    dra.node.kubelet.wait_for(registered_with(4, GPU_RESOURCE), TIMEOUT)
    dra.node.wait_log("DRA: ", TIMEOUT)
    status = status_of(dra.node)
    assert "kubeconfig: current-context is not set" in status["dra"]["error"]
    claim = dra.claim("any", "gpu-4")
    assert "cannot read the claim" in dra.kubelet.prepare(DRIVER, [claim])[claim[2]].error
    assert dra.node.daemon is not None
    dra.node.daemon.send_signal(signal.SIGHUP)
    dra.node.wait_log("reloaded the config", TIMEOUT)


def status_of(node: SimulatedNode) -> dict[str, Any]:
    return statusclient.status(f"unix:{node.status_socket}")


@pytest.mark.skipif(podman.podman_available() is not None, reason=f"cannot run containers: {podman.podman_available()}")
def test_a_container_runs_with_the_cdi_names_prepare_returned(dra: Dra, short_tmp: Path) -> None:
    drv = driverroot.build(short_tmp / "drv")
    real_device_nodes(dra.node)
    dra.start(dra.config(extra=f"  nvidiaDriverRoot: {drv.root}\n"))
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    claim = dra.claim("run", "gpu-6")
    (answer,) = dra.kubelet.prepare(DRIVER, [claim]).values()
    ((_, _, _, names),) = answer.devices
    spec, spec_text = read_spec(dra.node)
    with podman.PodmanStore(short_tmp / "pm") as store:
        inside, context, _, ran = run_inside(store, dra.node, list(names), spec, spec_text)
    minor = int(dra.node.scenario_gpus()[6]["minor"])
    expected = expected_control_nodes() | {f"/dev/nvidia{minor}": (CHAR, NVIDIA_MAJOR, minor)}
    assert inside.devices == expected, f"the container must see GPU 6 alone\n{context}"
    check_driver_files(inside, spec, drv, context)
    print(f"podman run --device {' '.join(names)}: {ran:.2f}s")


def test_pods_are_named_for_the_gpus_they_hold_through_dra(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    uuids = [g["uuid"] for g in dra.node.scenario_gpus()]
    claim = dra.claim("train", "gpu-5")
    stored = dra.api._claims[("ml", "train")]  # reserved for its pod, as the scheduler leaves it
    stored["status"]["reservedFor"] = [{"resource": "pods", "name": "trainer-0", "uid": "pod-uid-1"}]
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]].error == ""
    rc, out, _ = devices(dra.node)
    print(out)
    assert rc == 0 and "pods: ml/trainer-0 (claim train)" in out, out
    row = next(line for line in out.splitlines() if line.startswith("5 "))
    assert "ml/trainer-0" in row, out
    _, metrics = statusclient.fetch(f"unix:{dra.node.status_socket}", "/metrics", timeout=5)
    assert (f'nvplug_device_allocated{{container="",namespace="ml",pod="trainer-0",resource="{DRIVER}",'
            f'uuid="{uuids[5]}"}} 1.0') in metrics  # fmt: skip
    dra.node.control.xid(5, 79)
    dra.node.wait_log("; in use by ml/trainer-0 (claim train)", TIMEOUT)
    # The pods survive a restart of nvplug with the claim's checkpoint.
    assert dra.node.stop_daemon() == 0
    dra.node.start_daemon()
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) >= 2, "registration of the restarted daemon")
    rc, out, _ = devices(dra.node)
    assert "pods: ml/trainer-0 (claim train)" in out, out
    # A kubelet that lists dynamic resources (1.36) names the container too.
    dra.node.kubelet.pod_resources.admit(
        Pod("ml", "trainer-0", (Container("main", {}, (ClaimDevice("ml", "train", DRIVER, NODE, "gpu-5"),)),))
    )
    dra.wait(lambda: "ml/trainer-0 (container main, claim train)" in devices(dra.node)[1], "the container named")
    # A second pod sharing the claim: the 1.36 kubelet lists the device twice in each pod's container (the
    # second entry with the CDI id twice). Each pod is named once.
    cdi = (f"k8s.{DRIVER}/claim=train-gpu-5",)
    for pod in ("trainer-0", "trainer-1"):
        shared = ClaimDevice("ml", "train", DRIVER, NODE, "gpu-5", cdi)
        dra.node.kubelet.pod_resources.admit(Pod("ml", pod, (Container("main", {}, (shared,)),)))
    both = "pods: ml/trainer-0 (container main, claim train), ml/trainer-1 (container main, claim train)"
    dra.wait(lambda: both in devices(dra.node)[1], "each pod named once")
    _, metrics = statusclient.fetch(f"unix:{dra.node.status_socket}", "/metrics", timeout=5)
    assert metrics.count('pod="trainer-1"') == 1, metrics
    dra.node.kubelet.pod_resources.delete("ml", "trainer-1")
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    assert d.verdict(11) == "PASS", d
    # A pod the kubelet says holds a device through a claim nvplug never prepared: doctor says so.
    stray = ClaimDevice("ml", "stray", DRIVER, NODE, "gpu-6")
    dra.node.kubelet.pod_resources.admit(Pod("ml", "other-0", (Container("main", {}, (stray,)),)))
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    assert d.verdict(11) == "FAIL", d
    assert "gives gpu.nvidia.com gpu-6 to ml/other-0 (container main, claim stray), which nvplug has not" in d.out
