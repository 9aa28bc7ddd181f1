"""A host process's pod, from its cgroup path and the kubelet's pod log directories."""

from __future__ import annotations

import pytest

from nvplug.pods.process_pod import PodName, ProcessPod, pod_names, pod_of_cgroup, uids_by_name

UID = "5d9c2e4a-1b7f-4c3e-9a2d-6f0e8b1c3a57"
CID = "3f1a9c0e7b2d4e6f8a1b3c5d7e9f0a2b4c6d8e0f1a3b5c7d9e1f3a5b7c9d1e3f"


@pytest.mark.parametrize(
    "text, found",
    [
        # cgroup v2, systemd driver, each QoS class (Guaranteed has no class segment).
        (
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
            f"cri-containerd-{CID}.scope\n",
            ProcessPod(UID, CID),
        ),
        (
            f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
            ProcessPod(UID, CID),
        ),
        # cgroup v2, cgroupfs driver, under a node-level --cgroup-root.
        (f"0::/node.slice/kubepods/burstable/pod{UID}/{CID}\n", ProcessPod(UID, CID)),
        (f"0::/kubepods/pod{UID}/{CID}\n", ProcessPod(UID, CID)),
        # cgroup v1: the memory hierarchy's line; the others hold nothing of the pod.
        (
            f"12:cpu,cpuacct:/\n4:memory:/kubepods/besteffort/pod{UID}/{CID}\n1:name=systemd:/user.slice\n",
            ProcessPod(UID, CID),
        ),
        # A pod's cgroup with no container under it (a process the kubelet did not place): the pod alone.
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice\n",
            ProcessPod(UID, None),
        ),
        # Not in a pod: a systemd service, a user's session, a v1 controller the kubelet does not use.
        ("0::/system.slice/mps-client.service\n", None),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
        (f"5:devices:/kubepods/pod{UID}/{CID}\n", None),
        ("", None),
    ],
)
def test_the_pod_of_a_cgroup_path(text: str, found: ProcessPod | None) -> None:
    assert pod_of_cgroup(text) == found


def test_pod_names_from_the_kubelet_s_log_directories() -> None:
    names = pod_names([f"team-a_train-0_{UID}", "kube-system_nvplug_not-a-uid", "stray", f"x_y_z_{UID}"])
    assert names == {UID: PodName("team-a", "train-0")}
    assert str(names[UID]) == "team-a/train-0"


def test_a_pod_s_uid_by_its_name_unless_two_pods_had_that_name() -> None:
    other = UID.replace("0", "1")
    names = {UID: PodName("ml", "train-0"), other: PodName("ml", "train-0"), "u-2": PodName("ml", "infer")}
    # train-0 made again under its name, the old one's records not yet removed: which UID is whose is unknown.
    assert uids_by_name(names) == {("ml", "infer"): "u-2"}
