"""Source and Sink: how the edges meet the core.

A source turns the world (netlink, inotify, NVML) into typed events and hands them to the bus;
a sink turns each new snapshot into something outside (a file, a socket, a log line). The
daemon starts, stops and calls every one of them the same way, in the order its wiring lists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from nvplug.config import Config
from nvplug.core.events import Event
from nvplug.core.snapshot import Change, Snapshot
from nvplug.core.telemetry import Telemetry

Publish = Callable[[Event], None]
"""The bus's publish: safe from any thread."""

Emit = Callable[[Event], Awaitable[None]]
"""How a part feeds an event back, on the loop (a retry, an operator's heal, a daemon that quit): the state
takes it at once, as the dispatcher does with the bus's; what it returns is done once the parts that work
for it have (a caller outside a coroutine need not wait)."""

BlockingRunsOn = Literal["loop reader", "own thread", "nothing blocks"]
"""Where a source's blocking call runs; never on the loop itself."""

Commit = Callable[[Snapshot], Awaitable[None]]
"""What a prepared reload does, with the node as it is then, once every part has accepted the new config."""


async def no_change(snapshot: Snapshot) -> None:
    """The commit of a part that a config does not touch."""


class Source(Protocol):
    """Something that feeds the bus. Built with the bus's `Publish`; `start` opens it and returns at
    once (its blocking call runs where `blocking` says), `stop` closes it and is safe to repeat.

    `start` returns the task that runs the source, if it has one: the daemon fails if it ends.
    An OSError from `start` means the source cannot run here: the daemon goes on without it,
    saying `without` (what is lost), unless `without` is None.
    """

    name: str
    blocking: BlockingRunsOn
    without: str | None

    def start(self) -> asyncio.Task[None] | None: ...

    async def stop(self) -> None: ...


class TelemetryReader(Protocol):
    """GPU figures read when asked (a scrape): `refresh` reads what is due and answers within its budget,
    with stale figures marked."""

    async def refresh(self) -> Telemetry: ...


@runtime_checkable
class FirstEvents(Protocol):
    """A source that knows something before the first list (the first scan, what the kernel log said before
    we started). Once every source started, the daemon asks each that has it, in the wiring's order, with the
    node as the earlier ones left it, and applies what it returns before serving."""

    async def first_events(self, snapshot: Snapshot) -> Sequence[Event]: ...


class Worker(Protocol):
    """A part that does the work some events ask for (kubelet.sock came, a socket or directory went, a
    rescan is wanted, a new inventory to follow): the dispatcher hands each event whose type is in
    `works` to `work`, in the wiring's order, after the state took it (if it is state at all)."""

    works: frozenset[type]

    async def work(self, event: Event) -> None: ...


@dataclass(frozen=True)
class StateUpdate:
    """What one event did (or several, merged for the sinks after the list): the snapshot after it,
    the changes it meant, whether the picture moved on (a new revision), and the snapshot's fields
    that changed. A sink is called only for the fields it reads."""

    snapshot: Snapshot
    changes: tuple[Change, ...]
    revised: bool
    changed: frozenset[str] = frozenset()

    def then(self, later: StateUpdate) -> StateUpdate:
        """This update followed by a later one, as one."""
        return StateUpdate(
            later.snapshot, self.changes + later.changes, self.revised or later.revised, self.changed | later.changed
        )


@dataclass(frozen=True)
class HealthVerdict:
    """A part's say in /healthz. Unhealthy: /healthz answers 503 with the status line, whose notes say
    why. Healthy: `notes` are what /healthz adds after "ok" (what is served, but not all of it)."""

    healthy: bool = True
    notes: tuple[str, ...] = ()


HEALTHY = HealthVerdict()


class Sink(Protocol):
    """Something that reacts to each new snapshot. Subclass it for the defaults.

    `update` runs on the loop; for a sink `before_list`, with no await between the state change and it,
    so whatever it returns is applied before any ListAndWatch stream runs again. A sink reads the
    snapshots it is handed (`open`, `update`), never the live state. `prepare` checks a reloaded config
    and raises (ValueError, ConfigError) to refuse it; nothing changes until every part accepted and
    the commits run.
    """

    name: str
    # The snapshot's fields `update` depends on (snapshot.py's NODE_FIELDS, or its INVENTORY, HEALTH,
    # REVISED): it is skipped when only other fields changed. None: every update, with or without a
    # new revision (it reads `changes`, the log's lines).
    reads: frozenset[str] | None = None
    # Whether a ListAndWatch message depends on it (the CDI spec, before Allocate hands out its names; the
    # fleet, whose streams list what it is handed), or it must hold each snapshot as soon as it is made
    # (the state file, which `written` writes): those run at once, in order, and must be cheap. The others
    # run in the loop turn after the message's hand-off, in order, with every update since merged into
    # one: no fsync, label file or log line holds up a list.
    before_list: bool = False
    # The event types it does work for (Worker): none by default.
    works: frozenset[type] = frozenset()
    # Whether it closes before the sources stop, as well as with the other sinks after: what it closes needs a
    # source still running (a retiring MPS group's compute modes go back through the scanner's NVML).
    closes_before_sources: bool = False

    async def open(self, snapshot: Snapshot) -> None:
        """Once the sources run and the first scan is in `snapshot`: serve what it serves (the device
        plugins' sockets, DRA's), in the wiring's order. Named apart from a Source's `start`, which a
        part that is both (the re-prober) has too."""
        return None  # noqa: RET501 (a body: a protocol's method without one is abstract)

    def wants(self, update: StateUpdate) -> bool:
        return self.reads is None or not self.reads.isdisjoint(update.changed)

    def update(self, update: StateUpdate) -> Sequence[Event]:
        return ()

    async def work(self, event: Event) -> None:
        """What an event of a type in `works` asks of it."""
        return None  # noqa: RET501 (a body: a protocol's method without one is abstract)

    async def admit(self, cfg: Config) -> None:
        """Before `prepare`, what a reload may only be refused for after asking the node (NVML, a
        daemon): raises to refuse it, as `prepare` does."""
        return None  # noqa: RET501 (a body: a protocol's method without one is abstract)

    def prepare(self, cfg: Config) -> Commit:
        return no_change

    def notes(self) -> list[str]:
        """What the status line says of it; nothing when all is well."""
        return []

    def verdict(self) -> HealthVerdict:
        """Whether /healthz may say "ok" as far as this part goes, and what it adds if so."""
        return HEALTHY

    def status(self) -> object:
        """Its part of /status, under its name; None leaves it out."""
        return None

    async def close(self) -> None:
        return None
