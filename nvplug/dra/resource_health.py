"""The kubelet's DRA resource-health stream (DRAResourceHealth/NodeWatchResources, KEP-4680).

Each response is the complete list of the pool's devices, named as in the slices (pool, device):
Healthy, Unhealthy with the reason, or Unknown while nvplug cannot check the GPU (an NVML call on
it hangs). It goes out at once on every change, and again well within the kubelet's timeout: a
device not reported again turns Unknown, and a pod on it shows that in its status.

The service is served as v1alpha1 (which kubelets 1.34 to 1.36 call at every registration, listed or
not), v1beta1 and v1 (which later kubelets pick from GetInfo, v1 first): the messages are the same
in each, field for field, so one set of classes serves all three.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from nvplug.protos import dra_health_v1alpha1_pb2 as pb

log = logging.getLogger("nvplug.dra")

# Newest first, as GetInfo lists them.
SERVICES = ("v1.DRAResourceHealth", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
# The kubelet's timeout, said in each report, and the resend well within it.
TIMEOUT_SECONDS = 30
RESEND_SECONDS = 10.0
# The kubelet keeps at most this much of a message.
MAX_MESSAGE = 1024

ReportedHealth = Literal["Healthy", "Unhealthy", "Unknown"]
_STATUS = {"Healthy": pb.HEALTHY, "Unhealthy": pb.UNHEALTHY, "Unknown": pb.UNKNOWN}


@dataclass(frozen=True)
class DeviceReport:
    device: str
    health: ReportedHealth
    message: str = ""


class HealthStream:
    """What every open stream sends: the reports, and a wake-up for each change."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._reports: tuple[DeviceReport, ...] = ()
        self._changed = asyncio.Event()
        self.streams = 0
        self.sent = 0

    def update(self, reports: Sequence[DeviceReport]) -> None:
        reports = tuple(reports)
        if reports == self._reports:
            return
        self._reports = reports
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def response(self) -> Any:
        now = int(time.time())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=self.pool, device_name=r.device),
                    health=_STATUS[r.health],
                    last_updated_time=now,
                    health_check_timeout_seconds=TIMEOUT_SECONDS,
                    message=r.message[:MAX_MESSAGE],
                )
                for r in self._reports
            ]
        )

    async def _watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.streams += 1
        log.debug("the kubelet watches the health of %d DRA devices", len(self._reports))
        try:
            while True:
                changed = self._changed
                yield self.response()
                self.sent += 1
                waiter = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait({waiter}, timeout=RESEND_SECONDS)
                finally:
                    waiter.cancel()
        finally:
            self.streams -= 1

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        method = grpc.unary_stream_rpc_method_handler(
            self._watch, pb.NodeWatchResourcesRequest.FromString, pb.NodeWatchResourcesResponse.SerializeToString
        )
        return [grpc.method_handlers_generic_handler(s, {"NodeWatchResources": method}) for s in SERVICES]
