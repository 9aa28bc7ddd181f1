"""A client of the kubelet's PodResources API (v1), asked only when an answer matters.

PodResources has no watch. nvplug asks when someone reads devices, /status or
/metrics, when a GPU turns Unhealthy, and shortly after an Allocate; a short
cache serves the rest. The kubelet allows about 100 requests a second (burst 10)
and answers ResourceExhausted beyond; nvplug keeps to a few a second of its own
and, refused all the same, serves its last answer for a while.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc

from nvplug.base.grpc_target import UNIX_SOCKET_OPTIONS, grpc_target
from nvplug.pods.pod_holders import ContainerDevices
from nvplug.protos import podresources_pb2 as pb

log = logging.getLogger("nvplug")

# Far below the kubelet's 100/s, burst 10.
RATE = 5.0
BURST = 5
# How long an answer serves other readers; a refusal by the kubelet's rate limit is honoured this long.
TTL = 2.0
REFUSED_FOR = 5.0
# How long after an Allocate to ask: the kubelet records the pod just after it answered.
AFTER_ALLOCATE = 1.0
# Bounded by the loop's own timer, not a gRPC deadline: gRPC core's timer list spreads its idle
# ticks apart for good after deadlines shorter than about 3 s (base/grpc_target.py says more).
TIMEOUT = 2.0


R = TypeVar("R")


class _Message(Protocol):
    def SerializeToString(self) -> bytes: ...


def _serialize(message: _Message) -> bytes:
    return message.SerializeToString()


class PodResourcesUnavailable(Exception):
    """The kubelet's PodResources cannot be asked now; the message says why."""


@dataclass(frozen=True)
class PodsAnswer:
    """The pods' devices as last read, or why they are unknown."""

    entries: tuple[ContainerDevices, ...] | None
    error: str | None
    at: float


class TokenBucket:
    """`rate` calls a second, `burst` at once: a caller waits for its token."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate, self._burst, self._clock = rate, burst, clock
        self._tokens = float(burst)
        self._at = clock()

    def delay(self) -> float:
        """Take a token, borrowing if none is left; how long to wait before using it."""
        self._refill()
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self._rate

    def allow(self) -> bool:
        """Take a token if one is there (as the kubelet's limiter does: a refused call takes none)."""
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now


def _entries(pods: Iterable[pb.PodResources]) -> tuple[ContainerDevices, ...]:
    """Each container's device-plugin devices, and its DRA devices (one entry per claimed device), each
    once: a 1.36 kubelet lists a claim that two pods share twice in each of their containers."""
    out: list[ContainerDevices] = []
    for pod in pods:
        for c in pod.containers:
            out += [
                ContainerDevices(pod.namespace, pod.name, c.name, d.resource_name, tuple(d.device_ids))
                for d in c.devices
            ]
            for dynamic in c.dynamic_resources:
                claim = dynamic.claim_name
                for r in dynamic.claim_resources:
                    device = (r.device_name,)
                    out.append(
                        ContainerDevices(pod.namespace, pod.name, c.name, r.driver_name, device, r.pool_name, claim)
                    )
    return tuple(dict.fromkeys(out))


class PodResourcesClient:
    def __init__(self, socket: Path, rate: float = RATE, burst: int = BURST, timeout: float = TIMEOUT) -> None:
        self.socket = socket
        self._bucket = TokenBucket(rate, burst)
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._refused_until = 0.0
        # What the kubelet's refusal said: while we hold off, that is still the reason, in the same
        # words (a reason is logged once; new words for it would log it again).
        self._refusal = ""
        self.calls = 0

    async def list_pods(self) -> tuple[ContainerDevices, ...]:
        response = await self._call("List", pb.ListPodResourcesRequest(), pb.ListPodResourcesResponse.FromString)
        return _entries(response.pod_resources)

    async def get(self, namespace: str, pod: str) -> tuple[ContainerDevices, ...]:
        request = pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace)
        response = await self._call("Get", request, pb.GetPodResourcesResponse.FromString)
        return _entries([response.pod_resources])

    async def allocatable(self) -> dict[str, list[str]]:
        """Device IDs the kubelet counts as allocatable, by resource."""
        response = await self._call(
            "GetAllocatableResources", pb.AllocatableResourcesRequest(), pb.AllocatableResourcesResponse.FromString
        )
        out: dict[str, list[str]] = {}
        for devices in response.devices:
            out.setdefault(devices.resource_name, []).extend(devices.device_ids)
        return out

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _call(self, method: str, request: _Message, parse: Callable[[bytes], R]) -> R:
        if not self.socket.is_socket():
            raise PodResourcesUnavailable(f"no PodResources socket at {self.socket} (kubelet down, or older than 1.13)")
        if time.monotonic() < self._refused_until:
            raise PodResourcesUnavailable(self._refusal)
        wait = self._bucket.delay()
        if wait:
            await asyncio.sleep(wait)
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(grpc_target(self.socket), options=UNIX_SOCKET_OPTIONS)
        call = self._channel.unary_unary(
            f"/v1.PodResourcesLister/{method}",
            request_serializer=_serialize,
            response_deserializer=parse,
        )
        self.calls += 1
        try:
            answer: R = await asyncio.wait_for(call(request), self._timeout)
        except TimeoutError as err:
            # Maybe a restarted kubelet's new socket, while the old one hangs: dial again next time.
            await self.close()
            raise PodResourcesUnavailable(f"{method} on {self.socket}: no answer within {self._timeout:g} s") from err
        except grpc.aio.AioRpcError as err:
            reason = f"{method} on {self.socket}: {err.code().name}: {err.details()}"
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._refused_until = time.monotonic() + REFUSED_FOR
                self._refusal = reason
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                # A restarted kubelet made a new socket: dial again next time.
                await self.close()
            raise PodResourcesUnavailable(reason) from err
        return answer


class PodView:
    """The last List answer, refreshed when older than `ttl` on demand; one call serves concurrent readers."""

    def __init__(self, client: PodResourcesClient | None, ttl: float = TTL) -> None:
        self.client = client
        self._ttl = ttl
        self._answer = PodsAnswer(None, "PodResources is off (nvplug.podResources.socket: off)", 0.0)
        self._inflight: asyncio.Task[PodsAnswer] | None = None
        self._said: str | None = None
        self._refresh: asyncio.TimerHandle | None = None
        self._refreshing: set[asyncio.Task[PodsAnswer]] = set()

    def after_allocate(self) -> None:
        """The kubelet records the pod just after Allocate: ask then, once for a burst of allocations."""
        if self.client is not None and self._refresh is None:
            self._refresh = asyncio.get_running_loop().call_later(AFTER_ALLOCATE, self._refresh_now)

    def _refresh_now(self) -> None:
        self._refresh = None
        task = asyncio.ensure_future(self.fresh(max_age=0.0))
        self._refreshing.add(task)
        task.add_done_callback(self._refreshing.discard)

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None
        await asyncio.gather(*self._refreshing, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    @property
    def answer(self) -> PodsAnswer:
        return self._answer

    async def fresh(self, max_age: float | None = None, wait: float | None = None) -> PodsAnswer:
        """An answer no older than `max_age` (default: the TTL), asking the kubelet if need be.

        `wait` bounds how long a reader waits for the kubelet (a slow kubelet must not stall /status):
        past it, the last answer serves, or none, while the question goes on.
        """
        if self.client is None:
            return self._answer
        limit = self._ttl if max_age is None else max_age
        if self._answer.at and time.monotonic() - self._answer.at <= limit:
            return self._answer
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._ask(self.client))
        try:
            return await asyncio.wait_for(asyncio.shield(self._inflight), wait)
        except TimeoutError:
            if self._answer.entries is not None:
                return self._answer
            return PodsAnswer(None, f"the kubelet's PodResources did not answer within {wait:g} s", time.monotonic())

    async def _ask(self, client: PodResourcesClient) -> PodsAnswer:
        try:
            entries = await client.list_pods()
        except PodResourcesUnavailable as err:
            # Said once per reason, not on every request; the last known holders stay shown as unknown.
            if str(err) != self._said:
                log.warning("which pod holds which GPU is unknown: %s", err)
                self._said = str(err)
            self._answer = PodsAnswer(None, str(err), time.monotonic())
            return self._answer
        if self._said is not None:
            log.info("PodResources answers again on %s", client.socket)
            self._said = None
        self._answer = PodsAnswer(entries, None, time.monotonic())
        return self._answer
