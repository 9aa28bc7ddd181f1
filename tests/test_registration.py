"""Registration never waits on a dead kubelet: a new kubelet.sock cancels a Register
that is stuck on the old one, and the new kubelet gets one at once."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from support.scraped_metrics import scrape, value

from nvplug.kubelet.registrar import LIST_WAIT, REGISTER_TIMEOUT, Registrar
from nvplug.protos import KUBELET_SOCKET
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_views import HUNG
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with

TIMEOUT = 15.0
# From the new kubelet.sock's creation to the new kubelet receiving Register: a bound that
# tells "cut short" from "stuck until REGISTER_TIMEOUT" on a busy machine. The figure itself
# is measured in bench/latency.py.
MAX_DELAY = REGISTER_TIMEOUT / 5
ROUNDS = 40


def hung_registers(count: int) -> Callable[[FakeKubelet], bool]:
    """A wait_for predicate: hung kubelets have taken `count` Registers in all."""

    def check(k: FakeKubelet) -> bool:
        return sum(r.error == HUNG for r in k.registrations) >= count

    return check


def registration_counters(node: SimulatedNode) -> tuple[float, float]:
    """(registrations, failures) as the daemon counts them, from /metrics."""
    found = scrape(node)
    registrations = value(found, "nvplug_registrations_total", resource=GPU_RESOURCE)
    return registrations, value(found, "nvplug_registration_failures_total", resource=GPU_RESOURCE)


@pytest.mark.parametrize("hung_kubelets", [1, 3])
def test_a_new_kubelet_sock_cancels_a_register_stuck_on_a_hung_kubelet(node: SimulatedNode, hung_kubelets: int) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)

    # A restart storm: kubelets that come up wedged, take our Register and never answer.
    # Each one that follows is a new kubelet.sock, which must cut the stuck Register short.
    for n in range(1, hung_kubelets + 1):
        node.kubelet.restart(hang=True)
        node.kubelet.wait_for(hung_registers(n), TIMEOUT)
    assert node.kubelet.hung
    time.sleep(0.5)
    # Stuck: nothing answered, nothing failed.
    assert node.kubelet.accepted_registrations() == 1
    assert registration_counters(node) == (1, 0)

    mark = len(node.log_text())
    node.kubelet.restart()
    # Well under REGISTER_TIMEOUT, which is what the stuck Register would otherwise take.
    node.kubelet.wait_for(registered_with(8), REGISTER_TIMEOUT / 2)
    created = node.kubelet.socket_created_at
    assert created is not None
    fresh = [r for r in node.kubelet.registrations if r.received_at >= created]
    assert fresh and all(r.accepted for r in fresh), node.kubelet.describe()
    delay = fresh[0].received_at - created
    # Once this line is in, so is every line before it.
    log = node.wait_log("registered with the kubelet", after=mark)
    cancelled = log.count("Register to the old kubelet cancelled: a new kubelet.sock appeared")
    # The new kubelet's ListAndWatch was served before the registration's own log line was written.
    assert log.rindex("kubelet opened ListAndWatch") < log.rindex("registered with the kubelet"), log
    print(
        f"new kubelet.sock -> Register received: {delay * 1000:.1f} ms "
        f"(after {hung_kubelets} hung kubelets; {cancelled} Registers cancelled)"
    )
    assert delay < MAX_DELAY, f"{delay * 1000:.1f} ms\n{node.kubelet.describe()}"

    # At least one per hung kubelet; a second wake for the same kubelet.sock (our rebind,
    # then its inotify event) cancels and repeats a Register too.
    assert cancelled >= hung_kubelets
    assert "DEADLINE_EXCEEDED" not in log
    # A cancelled Register is no failure. A refused one is, and is retried: a busy machine can dial the
    # new kubelet.sock between its bind and its listen, as it could a real kubelet's.
    registrations, failures = registration_counters(node)
    failed = re.findall(r"Register on \S+ failed: (\w+):", node.log_text())
    assert registrations >= 2 and failures == len(failed) and set(failed) <= {"UNAVAILABLE"}, failed


# ---------------------------------------------------------------------------
# The Registrar alone, against scripted Registration servers


class Registration:
    """A Registration service on <dir>/kubelet.sock that answers Register at once, or never."""

    def __init__(self, directory: Path, *, hang: bool) -> None:
        self.path = directory / KUBELET_SOCKET
        self.hang = hang
        self.received: list[float] = []
        self.created_at = 0.0
        self._server = grpc.aio.server()

    async def start(self) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            self._register,
            request_deserializer=pb.RegisterRequest.FromString,
            response_serializer=pb.Empty.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1beta1.Registration", {"Register": handler}),)
        )
        self.created_at = time.monotonic()
        self._server.add_insecure_port(f"unix:{self.path}")
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(None)

    async def _register(self, req: pb.RegisterRequest, context: object) -> pb.Empty:
        self.received.append(time.monotonic())
        if self.hang:
            never: asyncio.Future[pb.Empty] = asyncio.get_running_loop().create_future()
            return await never
        return pb.Empty()


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{predicate} not met within {timeout}s"
        await asyncio.sleep(0.005)


def test_registrar_wake_cancels_the_register_in_flight(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nvplug.kubelet.registrar")

    async def once(directory: Path) -> float:
        registrar = Registrar(directory, "example.com/gpu", "plug.sock", pb.DevicePluginOptions())
        old = Registration(directory, hang=True)
        await old.start()
        run = asyncio.create_task(registrar.run())
        new = Registration(directory, hang=False)
        try:
            await _until(lambda: len(old.received) == 1, 5.0)
            # The old kubelet's socket goes, a new one comes; the old one still holds the call.
            old.path.unlink()
            await new.start()
            registrar.wake()
            await asyncio.wait_for(registrar.registered.wait(), REGISTER_TIMEOUT / 10)
            assert (registrar.registrations, registrar.failures) == (1, 0)
            assert len(old.received) == 1 and len(new.received) == 1
            return new.received[0] - new.created_at
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await asyncio.gather(new.stop(), old.stop())

    async def main() -> list[float]:
        # Rounds, because a new Register that reused a pooled connection to the old
        # kubelet (and hung on it) did so only now and then.
        delays = []
        for n in range(ROUNDS):
            directory = short_tmp / str(n)
            directory.mkdir()
            delays.append(await once(directory))
        return delays

    delays = asyncio.run(main())
    print(f"wake -> Register received by the new server: max {max(delays) * 1000:.1f} ms in {ROUNDS} rounds")
    assert max(delays) < MAX_DELAY
    cancelled = [r for r in caplog.records if "Register to the old kubelet cancelled" in r.getMessage()]
    assert len(cancelled) == ROUNDS and cancelled[0].levelno == logging.INFO
    assert "a new kubelet.sock appeared" in cancelled[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_creation_event_of_the_kubelet_sock_a_register_went_to_registers_no_second_time(short_tmp: Path) -> None:
    """A rebind's Register may reach the new kubelet before its socket's creation event is read: that
    event must not cancel the call and register again. A kubelet.sock made after it does."""

    async def main() -> None:
        registrar = Registrar(short_tmp, "example.com/gpu", "plug.sock", pb.DevicePluginOptions())
        first = Registration(short_tmp, hang=True)  # slow to answer: the call is in flight
        await first.start()
        run = asyncio.create_task(registrar.run())
        second = Registration(short_tmp, hang=False)
        try:
            await _until(lambda: len(first.received) == 1, 5.0)
            registrar.kubelet_came()  # the event of the socket the call is on
            await asyncio.sleep(0.2)
            assert len(first.received) == 1 and not registrar.registered.is_set()
            first.path.unlink()
            await second.start()
            registrar.kubelet_came()  # a new kubelet.sock: the call in flight went to the old one
            await asyncio.wait_for(registrar.registered.wait(), 5.0)
            assert (len(first.received), len(second.received), registrar.registrations) == (1, 1, 1)
            registrar.kubelet_came()  # again for the same socket, once registered: nothing
            await asyncio.sleep(0.2)
            assert len(second.received) == 1 and registrar.registered.is_set()
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await asyncio.gather(first.stop(), second.stop())

    asyncio.run(main())


class Lists:
    """A server's first lists, as the registrar's Listing sees them: each is sent when the test says."""

    def __init__(self) -> None:
        self.streams_listed = 0
        self.asked: list[int] = []
        self._sent = asyncio.Event()

    async def listed_after(self, count: int) -> None:
        self.asked.append(count)
        while self.streams_listed <= count:
            await self._sent.wait()

    def send_first_list(self) -> None:
        self.streams_listed += 1
        self._sent.set()
        self._sent = asyncio.Event()


def test_a_register_s_bookkeeping_waits_for_the_first_list_the_kubelet_opens(short_tmp: Path) -> None:
    """The kubelet opens ListAndWatch as it answers Register: the first list goes out before the log and
    the status line of the registration. A kubelet that never lists delays them by LIST_WAIT at most."""

    async def main() -> None:
        lists = Lists()
        flips: list[tuple[bool, int]] = []
        registrar: Registrar

        def changed() -> None:
            flips.append((registrar.registered.is_set(), lists.streams_listed))

        registrar = Registrar(
            short_tmp, "example.com/gpu", "plug.sock", pb.DevicePluginOptions(), on_change=changed, listing=lists
        )
        kubelet = Registration(short_tmp, hang=False)
        await kubelet.start()
        run = asyncio.create_task(registrar.run())
        try:
            await _until(lambda: lists.asked == [0], 5.0)
            # Answered and counted, but not yet said: the kubelet's list comes first.
            assert registrar.registrations == 1 and not registrar.registered.is_set()
            lists.send_first_list()
            await asyncio.wait_for(registrar.registered.wait(), 1.0)
            assert flips[-1] == (True, 1)

            # A kubelet that answers and never lists: registered all the same, LIST_WAIT later.
            registrar.wake()
            woken = time.monotonic()
            await asyncio.wait_for(registrar.registered.wait(), LIST_WAIT + 2.0)
            waited = time.monotonic() - woken
            assert (registrar.registrations, lists.asked, lists.streams_listed) == (2, [0, 1], 1)
            assert LIST_WAIT <= waited < LIST_WAIT + 2.0
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await kubelet.stop()

    asyncio.run(main())


def test_a_new_kubelet_sock_while_waiting_for_the_list_registers_again(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Answered by the old kubelet, then a new kubelet.sock before its list: that is a registration (no
    cancelled Register), and the new kubelet gets one of its own."""
    caplog.set_level(logging.INFO, logger="nvplug.kubelet.registrar")

    async def main() -> None:
        lists = Lists()
        registrar = Registrar(short_tmp, "example.com/gpu", "plug.sock", pb.DevicePluginOptions(), listing=lists)
        old = Registration(short_tmp, hang=False)
        await old.start()
        run = asyncio.create_task(registrar.run())
        new = Registration(short_tmp, hang=False)
        try:
            await _until(lambda: lists.asked == [0], 5.0)
            old.path.unlink()
            await new.start()
            registrar.kubelet_came()
            await _until(lambda: len(new.received) == 1 and len(lists.asked) == 2, 5.0)
            lists.send_first_list()
            await asyncio.wait_for(registrar.registered.wait(), 1.0)
            assert (len(old.received), len(new.received), registrar.registrations, registrar.failures) == (1, 1, 2, 0)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await asyncio.gather(old.stop(), new.stop())

    asyncio.run(main())
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "cancelled" in m], said
    assert sum("registered with the kubelet" in m for m in said) == 2, said


def test_registrar_cancelled_mid_register_leaves_no_call_behind(short_tmp: Path) -> None:
    async def main() -> None:
        registrar = Registrar(short_tmp, "example.com/gpu", "plug.sock", pb.DevicePluginOptions())
        hung = Registration(short_tmp, hang=True)
        await hung.start()
        run = asyncio.create_task(registrar.run())
        try:
            await _until(lambda: len(hung.received) == 1, 5.0)
            run.cancel()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 1.0)
            assert run.cancelled()
            assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("Register ")]
            assert (registrar.registrations, registrar.failures) == (0, 0)
            assert not registrar.registered.is_set()
        finally:
            await hung.stop()

    asyncio.run(main())


def test_standin_hangs_and_a_restart_leaves_the_hung_kubelet_wedged(short_tmp: Path) -> None:
    async def register(timeout: float) -> None:
        async with grpc.aio.insecure_channel(f"unix:{short_tmp / KUBELET_SOCKET}") as channel:
            rpc = channel.unary_unary(
                "/v1beta1.Registration/Register",
                request_serializer=pb.RegisterRequest.SerializeToString,
                response_deserializer=pb.Empty.FromString,
            )
            req = pb.RegisterRequest(version="v1beta1", endpoint="plug.sock", resource_name="example.com/gpu")
            await rpc(req, timeout=timeout)

    async def main() -> None:
        kubelet = FakeKubelet(short_tmp)
        await kubelet.start(hang=True)
        assert (kubelet.hung, "HUNG" in kubelet.describe()) == (True, True)
        stuck = asyncio.create_task(register(30.0))
        await kubelet.wait_for(hung_registers(1), 5.0)
        [rec] = kubelet.registrations
        assert not rec.accepted and rec.error == HUNG and rec.received_at <= rec.at
        created = kubelet.socket_created_at

        await kubelet.restart()
        assert kubelet.serving and not kubelet.hung
        assert kubelet.socket_created_at is not None and created is not None
        assert kubelet.socket_created_at > created
        await asyncio.sleep(0.2)
        assert not stuck.done()  # wedged: neither an answer nor an error
        await kubelet.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(stuck, 5.0)

    asyncio.run(main())
