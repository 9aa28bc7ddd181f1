"""The status endpoint's HTTP, on a real unix socket: what a bad or slow request gets, and that the
answer still comes to a good one after it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from nvplug.status import status_server
from nvplug.status.status_server import MAX_REQUEST, StatusServer


async def _ask(path: Path, request: bytes, linger: bool = False) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(request)
    await writer.drain()
    if not linger:
        writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_bad_slow_and_good_requests_each_get_their_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_server, "READ_TIMEOUT", 0.5)
    socket = tmp_path / "status.sock"

    async def run() -> dict[str, bytes]:
        server = StatusServer(f"unix:{socket}", {"/ok": lambda: (200, "text/plain", b"fine\n")})
        await server.start()
        try:
            began = time.monotonic()
            # Only half a head, and the connection held open: only the request's deadline can answer it.
            slow = await _ask(socket, b"GET /ok HTTP/1.1\r\nHost: x\r\n", linger=True)
            print(f"half a request answered after {time.monotonic() - began:.2f} s (deadline 0.5 s)")
            return {
                "slow": slow,
                # A body that says it is larger than any request may be.
                "large": await _ask(socket, f"POST /ok HTTP/1.1\r\nContent-Length: {MAX_REQUEST + 1}\r\n\r\n".encode()),
                # A body shorter than it said, and then the end: no request.
                "short": await _ask(socket, b"POST /ok HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc"),
                "garbage": await _ask(socket, b"NONSENSE\r\n\r\n"),
                "length": await _ask(socket, b"GET /ok HTTP/1.1\r\nContent-Length: ten\r\n\r\n"),
                "post to a GET": await _ask(socket, b"POST /ok HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi"),
                "elsewhere": await _ask(socket, b"GET /nothing HTTP/1.1\r\n\r\n"),
                "good": await _ask(socket, b"GET /ok?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"),
            }
        finally:
            await server.stop()

    answers = asyncio.run(run())

    assert {what: _status(answer) for what, answer in answers.items()} == {
        "slow": 400,
        "large": 413,
        "short": 400,
        "garbage": 400,
        "length": 400,
        "post to a GET": 405,
        "elsewhere": 404,
        "good": 200,
    }
    assert answers["good"].endswith(b"\r\n\r\nfine\n")
    assert b"Content-Length: 5\r\n" in answers["good"]
