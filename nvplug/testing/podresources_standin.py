"""The kubelet's PodResources service (v1), as the kubelet stand-in serves it on a real unix socket.

It answers List, Get and GetAllocatableResources from what the stand-in admitted
(pods, their containers and the device IDs each was allocated) and from the devices
the plugins advertise. Like the kubelet it rate-limits the whole service (a token
bucket, 100 a second with a burst of 10 by default) and answers ResourceExhausted
"rejected by rate limit" beyond; every call is counted.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from nvplug.kubelet.podresources_client import TokenBucket
from nvplug.protos import podresources_pb2 as pb

SERVICE = "v1.PodResourcesLister"
QPS = 100.0
BURST = 10


@dataclass(frozen=True)
class ClaimDevice:
    """One DRA device of a container's claim, as the kubelet lists it (dynamic_resources)."""

    claim_namespace: str
    claim: str
    driver: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Container:
    name: str
    # Device IDs by resource name, as allocated.
    devices: Mapping[str, tuple[str, ...]]
    # DRA devices of its claims: listed only by a kubelet that serves dynamic resources.
    claimed: tuple[ClaimDevice, ...] = ()


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    containers: tuple[Container, ...]


class FakePodResources:
    def __init__(
        self,
        socket_path: Path,
        allocatable: Callable[[], Mapping[str, tuple[str, ...]]],
        qps: float = QPS,
        burst: int = BURST,
    ) -> None:
        self.socket_path = socket_path
        self._allocatable = allocatable
        self.pods: dict[tuple[str, str], Pod] = {}
        self.calls: Counter[str] = Counter()
        self.refused = 0
        # Seconds each call waits before it is answered: a kubelet that is slow to answer.
        self.delay = 0.0
        # KubeletPodResourcesDynamicResources: off in 1.32 (dynamic_resources empty), GA in 1.36.
        self.dynamic_resources = True
        self._bucket = TokenBucket(qps, burst)
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def set_limit(self, qps: float, burst: int) -> None:
        self._bucket = TokenBucket(qps, burst)

    async def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list, pb.ListPodResourcesRequest.FromString, pb.ListPodResourcesResponse.SerializeToString
            ),
            "Get": grpc.unary_unary_rpc_method_handler(
                self._get, pb.GetPodResourcesRequest.FromString, pb.GetPodResourcesResponse.SerializeToString
            ),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                self._allocatable_resources,
                pb.AllocatableResourcesRequest.FromString,
                pb.AllocatableResourcesResponse.SerializeToString,
            ),
        }
        # Threads of its own, as a kubelet's: a test that blocks the stand-in's loop (waiting on nvplug's
        # /status, which asks PodResources) must not stall the answer.
        server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="podresources"))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server = server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, lambda: server.stop(None).wait())
        self.socket_path.unlink(missing_ok=True)

    def admit(self, pod: Pod) -> None:
        self.pods[(pod.namespace, pod.name)] = pod

    def delete(self, namespace: str, name: str) -> None:
        self.pods.pop((namespace, name), None)

    def _limit(self, method: str, context: grpc.ServicerContext) -> None:
        if self.delay:
            time.sleep(self.delay)  # a slow kubelet
        with self._lock:
            self.calls[method] += 1
            allowed = self._bucket.allow()
            self.refused += not allowed
        if not allowed:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    def _list(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        self._limit("List", context)
        pods = list(self.pods.values())
        sharing = _sharing(pods) if self.dynamic_resources else Counter()
        return pb.ListPodResourcesResponse(pod_resources=[_message(p, self.dynamic_resources, sharing) for p in pods])

    def _get(self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext) -> pb.GetPodResourcesResponse:
        self._limit("Get", context)
        pod = self.pods.get((request.pod_namespace, request.pod_name))
        if pod is None:
            missing = f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            context.abort(grpc.StatusCode.NOT_FOUND, missing)
        assert pod is not None
        sharing = _sharing(list(self.pods.values())) if self.dynamic_resources else Counter()
        return pb.GetPodResourcesResponse(pod_resources=_message(pod, self.dynamic_resources, sharing))

    def _allocatable_resources(
        self, request: pb.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pb.AllocatableResourcesResponse:
        self._limit("GetAllocatableResources", context)
        devices = [pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in self._allocatable().items()]
        return pb.AllocatableResourcesResponse(devices=devices)


def _sharing(pods: list[Pod]) -> Counter[tuple[str, str]]:
    """How many pods hold each claim (namespace, name)."""
    return Counter(
        claim for pod in pods for claim in {(d.claim_namespace, d.claim) for c in pod.containers for d in c.claimed}
    )


def _message(pod: Pod, dynamic: bool, sharing: Counter[tuple[str, str]]) -> pb.PodResources:
    return pb.PodResources(
        name=pod.name,
        namespace=pod.namespace,
        containers=[
            pb.ContainerResources(
                name=c.name,
                # As the real kubelet (1.32) lists them: one entry per device, not one per resource.
                devices=[
                    pb.ContainerDevices(resource_name=r, device_ids=[i]) for r, ids in c.devices.items() for i in ids
                ],
                dynamic_resources=_dynamic(c.claimed, sharing) if dynamic else [],
            )
            for c in pod.containers
        ],
    )


def _dynamic(claimed: tuple[ClaimDevice, ...], sharing: Counter[tuple[str, str]]) -> list[pb.DynamicResource]:
    """One DynamicResource per claim, its devices in it. As a 1.36 kubelet lists a claim that several pods
    share: each device once per pod holding the claim, the n-th entry with its CDI ids n times."""
    by_claim: dict[tuple[str, str], list[ClaimDevice]] = {}
    for d in claimed:
        by_claim.setdefault((d.claim_namespace, d.claim), []).append(d)
    return [
        pb.DynamicResource(
            claim_name=name,
            claim_namespace=namespace,
            claim_resources=[
                pb.ClaimResource(
                    cdi_devices=[pb.CDIDevice(name=i) for i in d.cdi_ids * n],
                    driver_name=d.driver,
                    pool_name=d.pool,
                    device_name=d.device,
                )
                for d in devices
                for n in range(1, max(1, sharing[(namespace, name)]) + 1)
            ],
        )
        for (namespace, name), devices in by_claim.items()
    ]
