"""Tests of the Kubernetes API server stand-in, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from support.apiserver_standin import GROUP, ApiError, FakeApiServer

TOKEN = "test-token"
DRIVER = "gpu.nvidia.com"
SLICES = f"/apis/{GROUP}/v1/resourceslices"
BETA_SLICES = f"/apis/{GROUP}/v1beta1/resourceslices"
# A taint's timeAdded as the API server writes it: UTC, to the second.
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
OLD = "2020-01-01T00:00:00Z"


def call(
    server: FakeApiServer,
    method: str,
    path: str,
    body: Any = None,
    token: str | None = TOKEN,
    conn: http.client.HTTPConnection | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data: bytes | None = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=data, headers=sent)
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.getheader("Content-Type") == "application/json"
        assert int(resp.getheader("Content-Length") or -1) == len(raw)
        return resp.status, json.loads(raw)
    finally:
        if own:
            conn.close()


def device(name: str, version: str = "v1", **attributes: Any) -> dict[str, Any]:
    attrs = {"productName": {"string": "NVIDIA H100"}, "index": {"int": 0}, **attributes}
    fields = {"attributes": attrs, "capacity": {"memory": {"value": "81559Mi"}}}
    if version == "v1beta1":
        return {"name": name, "basic": fields}
    return {"name": name, **fields}


def resource_slice(
    node: str = "node-a",
    driver: str = DRIVER,
    name: str | None = None,
    version: str = "v1",
    devices: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": f"{node}-{driver}-"}
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
            "devices": devices if devices is not None else [device("gpu-0", version)],
        },
    }


def assert_status(body: dict[str, Any], code: int, reason: str) -> None:
    assert body["kind"] == "Status"
    assert body["apiVersion"] == "v1"
    assert body["status"] == "Failure"
    assert body["code"] == code
    assert body["reason"] == reason
    assert isinstance(body["message"], str) and body["message"]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


def test_discovery() -> None:
    with FakeApiServer(versions=("v1", "v1beta2")) as server:
        status, group = call(server, "GET", f"/apis/{GROUP}")
        assert status == 200
        assert group["kind"] == "APIGroup"
        assert group["name"] == GROUP
        assert [v["version"] for v in group["versions"]] == ["v1", "v1beta2"]
        assert group["preferredVersion"] == {"groupVersion": f"{GROUP}/v1", "version": "v1"}

        status, groups = call(server, "GET", "/apis")
        assert status == 200
        assert groups["kind"] == "APIGroupList"
        assert groups["groups"] == [group]

        status, resources = call(server, "GET", f"/apis/{GROUP}/v1beta2")
        assert status == 200
        assert {r["name"] for r in resources["resources"]} == {"resourceslices", "resourceclaims"}

        # A version the cluster does not serve is not there at all.
        status, body = call(server, "GET", f"/apis/{GROUP}/v1beta1/resourceslices")
        assert status == 404
        assert_status(body, 404, "NotFound")
        status, body = call(server, "GET", "/api/v1/nodes")
        assert status == 404
        assert_status(body, 404, "NotFound")


def test_auth(api: FakeApiServer, tmp_path: Path) -> None:
    for token in (None, "wrong"):
        status, body = call(api, "GET", SLICES, token=token)
        assert status == 401
        assert_status(body, 401, "Unauthorized")
    status, _ = call(api, "GET", SLICES, headers={"Authorization": f"Basic {TOKEN}"}, token=None)
    assert status == 401
    assert call(api, "GET", SLICES)[0] == 200

    good = yaml.safe_load(api.write_kubeconfig(tmp_path / "kubeconfig").read_text())
    assert good["current-context"] == good["contexts"][0]["name"]
    assert good["clusters"][0]["cluster"]["server"] == api.url
    assert good["users"][0]["user"]["token"] == TOKEN
    bad = yaml.safe_load(api.write_kubeconfig(tmp_path / "bad", token="nope").read_text())
    assert call(api, "GET", SLICES, token=bad["users"][0]["user"]["token"])[0] == 401

    with FakeApiServer(token=None) as open_server:
        assert call(open_server, "GET", SLICES, token=None)[0] == 200
    assert [r[2] for r in api.requests] == [401, 401, 401, 200, 401]


def test_create_with_generate_name(api: FakeApiServer) -> None:
    status, created = call(api, "POST", SLICES, resource_slice())
    assert status == 201
    meta = created["metadata"]
    prefix = f"node-a-{DRIVER}-"
    assert meta["name"].startswith(prefix)
    suffix = meta["name"][len(prefix) :]
    assert len(suffix) == 5 and suffix.isalnum() and suffix == suffix.lower()
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0
    assert created["apiVersion"] == f"{GROUP}/v1" and created["kind"] == "ResourceSlice"
    assert api.slices() == [created]

    status, second = call(api, "POST", SLICES, resource_slice())
    assert status == 201
    assert second["metadata"]["name"] != meta["name"]
    assert int(second["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])

    status, body = call(api, "POST", SLICES, resource_slice(name="fixed"))
    assert status == 201 and body["metadata"]["name"] == "fixed"
    status, body = call(api, "POST", SLICES, resource_slice(name="fixed"))
    assert status == 409
    assert_status(body, 409, "AlreadyExists")
    assert body["details"]["name"] == "fixed"

    status, body = call(api, "POST", SLICES, resource_slice(name="other", version="v1beta1"))
    assert status == 400
    assert_status(body, 400, "BadRequest")
    assert "v1beta1" in body["message"]
    assert len(api.slices()) == 3


def test_list_with_field_selector(api: FakeApiServer) -> None:
    for name, node, driver in (("b", "node-a", DRIVER), ("a", "node-a", "other.example.com"), ("c", "node-b", DRIVER)):
        assert call(api, "POST", SLICES, resource_slice(node=node, driver=driver, name=name))[0] == 201

    status, listed = call(api, "GET", SLICES)
    assert status == 200
    assert listed["kind"] == "ResourceSliceList"
    assert listed["apiVersion"] == f"{GROUP}/v1"
    assert int(listed["metadata"]["resourceVersion"]) >= 3
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a", "b", "c"]

    def names(selector: str) -> list[str]:
        status, body = call(api, "GET", f"{SLICES}?fieldSelector={quote(selector)}")
        assert status == 200
        return [i["metadata"]["name"] for i in body["items"]]

    assert names("spec.nodeName=node-a") == ["a", "b"]
    assert names(f"spec.driver={DRIVER}") == ["b", "c"]
    assert names(f"spec.nodeName=node-a,spec.driver={DRIVER}") == ["b"]
    assert names("spec.nodeName=node-z") == []
    assert names("spec.nodeName!=node-a") == ["c"]

    status, body = call(api, "GET", f"{SLICES}?fieldSelector={quote('spec.pool.name=x')}")
    assert status == 400
    assert_status(body, 400, "BadRequest")
    assert [s["metadata"]["name"] for s in api.slices(node="node-a", driver=DRIVER)] == ["b"]


def test_update_needs_current_resource_version(api: FakeApiServer) -> None:
    _, created = call(api, "POST", SLICES, resource_slice(name="s"))
    stale = json.loads(json.dumps(created))
    path = f"{SLICES}/s"

    created["spec"]["pool"]["generation"] = 1
    status, updated = call(api, "PUT", path, created)
    assert status == 200
    assert int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    assert updated["metadata"]["uid"] == created["metadata"]["uid"]
    assert updated["metadata"]["generation"] == 2

    stale["spec"]["pool"]["generation"] = 5
    status, body = call(api, "PUT", path, stale)
    assert status == 409
    assert_status(body, 409, "Conflict")
    assert api.slices()[0]["spec"]["pool"]["generation"] == 1

    missing = json.loads(json.dumps(updated))
    del missing["metadata"]["resourceVersion"]
    assert call(api, "PUT", path, missing)[0] == 409

    status, body = call(api, "PUT", f"{SLICES}/other", updated)
    assert status == 400 and "does not match the name on the URL" in body["message"]

    moved = json.loads(json.dumps(updated))
    moved["spec"]["nodeName"] = "node-b"
    status, body = call(api, "PUT", path, moved)
    assert status == 422 and "spec.nodeName" in body["message"]

    status, got = call(api, "GET", path)
    assert status == 200 and got == updated

    ghost = json.loads(json.dumps(updated))
    ghost["metadata"]["name"] = "ghost"
    assert call(api, "PUT", f"{SLICES}/ghost", ghost)[0] == 404


def test_delete(api: FakeApiServer) -> None:
    _, created = call(api, "POST", SLICES, resource_slice(name="s"))
    status, body = call(api, "DELETE", f"{SLICES}/s")
    assert status == 200
    assert body["kind"] == "Status" and body["status"] == "Success"
    assert body["details"]["uid"] == created["metadata"]["uid"]
    assert api.slices() == []
    status, body = call(api, "GET", f"{SLICES}/s")
    assert status == 404
    assert_status(body, 404, "NotFound")
    assert body["details"] == {"name": "s", "group": GROUP, "kind": "resourceslices"}
    assert call(api, "DELETE", f"{SLICES}/s")[0] == 404


def test_delete_collection_by_node(api: FakeApiServer) -> None:
    for name, node in (("a", "node-a"), ("b", "node-b")):
        call(api, "POST", SLICES, resource_slice(node=node, name=name))
    status, body = call(api, "DELETE", f"{SLICES}?fieldSelector={quote('spec.nodeName=node-a')}")
    assert status == 200
    assert [i["metadata"]["name"] for i in body["items"]] == ["a"]
    assert [s["metadata"]["name"] for s in api.slices()] == ["b"]


def invalid(api: FakeApiServer, obj: dict[str, Any], field: str, path: str = SLICES) -> dict[str, Any]:
    status, body = call(api, "POST", path, obj)
    assert status == 422, body
    assert_status(body, 422, "Invalid")
    assert field in body["message"]
    assert any(field in c["field"] for c in body["details"]["causes"])
    return body


def test_validation(api: FakeApiServer) -> None:
    invalid(api, resource_slice(devices=[device(f"gpu-{i}") for i in range(129)]), "spec.devices")
    assert call(api, "POST", SLICES, resource_slice(devices=[device(f"gpu-{i}") for i in range(128)]))[0] == 201

    bad_attr = resource_slice(devices=[device("gpu-0", uuid={"string": "GPU-1", "int": 1})])
    invalid(api, bad_attr, "spec.devices[0].attributes[uuid]")
    invalid(api, resource_slice(devices=[device("gpu-0", uuid="GPU-1")]), "spec.devices[0].attributes[uuid]")
    invalid(
        api, resource_slice(devices=[device("gpu-0", driverVersion={"version": "12.4"})]), "attributes[driverVersion]"
    )
    too_many: dict[str, Any] = {f"a{i}": {"int": i} for i in range(32)}
    invalid(api, resource_slice(devices=[device("gpu-0", **too_many)]), "spec.devices[0]")

    invalid(api, resource_slice(devices=[device("GPU_0")]), "spec.devices[0].name")
    invalid(api, resource_slice(devices=[device("gpu-0"), device("gpu-0")]), "spec.devices[1].name")
    no_value = resource_slice(devices=[{"name": "gpu-0", "capacity": {"memory": {"quantity": "1Gi"}}}])
    invalid(api, no_value, "spec.devices[0].capacity[memory]")
    bad_taint = resource_slice(devices=[{"name": "gpu-0", "taints": [{"key": "k", "effect": "Evict"}]}])
    invalid(api, bad_taint, "spec.devices[0].taints[0].effect")

    for field in ("driver", "pool"):
        obj = resource_slice()
        del obj["spec"][field]
        invalid(api, obj, f"spec.{field}")
    obj = resource_slice()
    obj["spec"]["pool"]["resourceSliceCount"] = 0
    invalid(api, obj, "spec.pool.resourceSliceCount")
    obj = resource_slice()
    obj["spec"]["allNodes"] = True
    invalid(api, obj, "spec")

    # Every error is reported, not only the first.
    obj = resource_slice()
    del obj["spec"]["driver"]
    obj["spec"]["pool"]["generation"] = -1
    body = invalid(api, obj, "spec.driver")
    assert {c["field"] for c in body["details"]["causes"]} == {"spec.driver", "spec.pool.generation"}
    assert len(api.slices()) == 1


def test_device_shape_follows_the_url_version() -> None:
    with FakeApiServer(versions=("v1beta1", "v1")) as server:
        beta = f"/apis/{GROUP}/v1beta1/resourceslices"
        # The v1 shape sent to v1beta1, and the v1beta1 shape sent to v1.
        invalid(
            server, resource_slice(version="v1beta1", devices=[device("gpu-0")]), "spec.devices[0].attributes", beta
        )
        invalid(server, resource_slice(devices=[device("gpu-0", "v1beta1")]), "spec.devices[0].basic")

        taint = {"key": "example.com/unhealthy", "value": "xid-79", "effect": "NoExecute", "timeAdded": OLD}
        dev = device("gpu-0", "v1beta1")
        dev["basic"]["taints"] = [taint]
        status, created = call(server, "POST", beta, resource_slice(name="s", version="v1beta1", devices=[dev]))
        assert status == 201
        # Read at the other version, the same slice comes back in that version's shape.
        status, as_v1 = call(server, "GET", f"{SLICES}/s")
        assert status == 200
        assert as_v1["apiVersion"] == f"{GROUP}/v1"
        assert as_v1["spec"]["devices"] == [{"name": "gpu-0", **dev["basic"]}]
        assert call(server, "GET", f"{beta}/s")[1] == created


def test_bad_requests(api: FakeApiServer) -> None:
    status, body = call(api, "POST", SLICES, b"{not json")
    assert status == 400
    assert_status(body, 400, "BadRequest")
    status, body = call(api, "POST", SLICES, resource_slice(), headers={"Content-Type": "text/plain"})
    assert status == 415
    assert_status(body, 415, "UnsupportedMediaType")
    status, body = call(api, "PATCH", f"{SLICES}/s", {})
    assert status == 405
    assert_status(body, 405, "MethodNotAllowed")
    assert call(api, "POST", "/apis", {})[0] == 405
    assert call(api, "GET", f"{SLICES}/s/status")[0] == 404
    assert api.slices() == []


def test_claims(api: FakeApiServer) -> None:
    api.add_claim(
        {
            "apiVersion": f"{GROUP}/v1beta1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "team", "name": "gpu-claim"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        }
    )
    path = f"/apis/{GROUP}/v1/namespaces/team/resourceclaims/gpu-claim"
    status, claim = call(api, "GET", path)
    assert status == 200
    assert claim["apiVersion"] == f"{GROUP}/v1"
    assert claim["metadata"]["name"] == "gpu-claim"
    assert claim["metadata"]["uid"] and claim["metadata"]["resourceVersion"]
    assert claim["spec"]["devices"]["requests"][0]["name"] == "gpu"

    status, body = call(api, "GET", f"/apis/{GROUP}/v1/namespaces/other/resourceclaims/gpu-claim")
    assert status == 404
    assert_status(body, 404, "NotFound")
    api.delete_claim("team", "gpu-claim")
    assert call(api, "GET", path)[0] == 404


def test_fail_next(api: FakeApiServer) -> None:
    api.fail_next(2, status=503, reason="ServiceUnavailable")
    for _ in range(2):
        status, body = call(api, "GET", SLICES)
        assert status == 503
        assert_status(body, 503, "ServiceUnavailable")
    assert call(api, "GET", SLICES)[0] == 200
    api.fail_next(1)
    status, body = call(api, "POST", SLICES, resource_slice())
    assert status == 500
    assert_status(body, 500, "InternalError")
    assert api.slices() == []
    assert api.requests == [
        ("GET", SLICES, 503),
        ("GET", SLICES, 503),
        ("GET", SLICES, 200),
        ("POST", SLICES, 500),
    ]


def test_keep_alive_and_restart(api: FakeApiServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=5)
    assert call(api, "POST", SLICES, resource_slice(name="s"), conn=conn)[0] == 201
    assert call(api, "GET", f"{SLICES}/s", conn=conn)[0] == 200
    sock = conn.sock
    assert call(api, "GET", f"{SLICES}/s", conn=conn)[0] == 200
    assert conn.sock is sock, "the connection was not kept alive"

    url = api.url
    api.stop()
    # The kept-alive connection was closed under the client, and nothing listens.
    with pytest.raises((http.client.HTTPException, OSError)):
        call(api, "GET", f"{SLICES}/s", conn=conn)
    conn.close()
    with pytest.raises(ConnectionRefusedError):
        call(api, "GET", SLICES)

    api.start()
    assert api.url == url
    status, got = call(api, "GET", f"{SLICES}/s")
    assert status == 200 and got["metadata"]["name"] == "s"

    api.restart()
    assert api.url == url and [s["metadata"]["name"] for s in api.slices()] == ["s"]
    api.restart(keep_state=False)
    assert api.url == url and api.slices() == []
    status, listed = call(api, "GET", SLICES)
    assert status == 200 and listed["items"] == []


def test_stop_does_not_wait_for_idle_connections(api: FakeApiServer) -> None:
    conns = [http.client.HTTPConnection("127.0.0.1", api.port, timeout=5) for _ in range(5)]
    for conn in conns:
        assert call(api, "GET", SLICES, conn=conn)[0] == 200
    # A connection that never sent a request at all.
    raw = socket.create_connection(("127.0.0.1", api.port), timeout=5)
    time.sleep(0.2)
    started = time.monotonic()
    api.stop()
    assert time.monotonic() - started < 2.0
    # Closed, not left hanging (a timeout would raise): EOF once accepted, a reset if still queued.
    with contextlib.suppress(ConnectionResetError):
        assert raw.recv(1) == b""
    raw.close()
    for conn in conns:
        conn.close()
    assert not [t for t in threading.enumerate() if t.name == "fake-apiserver-conn"]


def test_delete_slices(api: FakeApiServer) -> None:
    for name, node in (("a1", "node-a"), ("a2", "node-a"), ("b1", "node-b")):
        assert call(api, "POST", SLICES, resource_slice(node=node, name=name))[0] == 201
    assert api.delete_slices("node-a") == 2
    assert api.delete_slices("node-a") == 0
    assert [s["metadata"]["name"] for s in api.slices()] == ["b1"]
    status, listed = call(api, "GET", f"{SLICES}?fieldSelector={quote('spec.nodeName=node-a')}")
    assert status == 200 and listed["items"] == []


def test_concurrent_clients(api: FakeApiServer) -> None:
    errors: list[BaseException] = []

    def create(i: int) -> None:
        try:
            status, _ = call(api, "POST", SLICES, resource_slice(node=f"node-{i}"))
            assert status == 201
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    versions = [int(s["metadata"]["resourceVersion"]) for s in api.slices()]
    assert len(api.slices()) == 20 and len(set(versions)) == 20
    assert len(api.requests) == 20


# Watch.


class WatchStream:
    """A raw watch on its own socket: the head, then the chunked body read chunk by chunk.

    Each chunk must be exactly one JSON event and its newline. Reads keep their place across a
    timeout, so a test can wait for silence and go on reading.
    """

    def __init__(self, server: FakeApiServer, query: str, version: str = "v1", token: str | None = TOKEN) -> None:
        self.token = token
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        self.buf = b""
        self.path = f"/apis/{GROUP}/{version}/resourceslices?{query}"
        self.status, self.headers = self.send("GET", self.path)

    def send(self, method: str, path: str) -> tuple[int, dict[str, str]]:
        auth = f"Authorization: Bearer {self.token}\r\n" if self.token else ""
        self.sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
        head = self._until(b"\r\n\r\n", time.monotonic() + 5).decode("latin-1")
        status_line, *lines = head.split("\r\n")
        headers = {}
        for line in lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        return int(status_line.split(" ")[1]), headers

    def body(self) -> dict[str, Any]:
        """A plain answer's body (one with Content-Length)."""
        size = int(self.headers["content-length"])
        deadline = time.monotonic() + 5
        while len(self.buf) < size:
            self._fill(deadline)
        data, self.buf = self.buf[:size], self.buf[size:]
        return dict(json.loads(data))

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("nothing came in time")
        self.sock.settimeout(remaining)
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self.buf += data

    def _until(self, marker: bytes, deadline: float) -> bytes:
        while marker not in self.buf:
            self._fill(deadline)
        head, _, self.buf = self.buf.partition(marker)
        return head

    def _take_chunk(self) -> bytes | None:
        end = self.buf.find(b"\r\n")
        if end < 0:
            return None
        size = int(self.buf[:end], 16)
        total = end + 2 + size + 2
        if len(self.buf) < total:
            return None
        data = self.buf[end + 2 : end + 2 + size]
        assert self.buf[end + 2 + size : total] == b"\r\n"
        self.buf = self.buf[total:]
        return data

    def next(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """The next event; None once the body ended with its terminating chunk."""
        deadline = time.monotonic() + timeout
        while True:
            chunk = self._take_chunk()
            if chunk == b"":
                return None
            if chunk is not None:
                assert chunk.endswith(b"\n") and chunk.count(b"\n") == 1, chunk
                event = json.loads(chunk)
                assert set(event) == {"type", "object"}
                return dict(event)
            self._fill(deadline)

    def events(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        for _ in range(count):
            event = self.next(timeout)
            assert event is not None, f"the watch ended after {got}"
            got.append(event)
        return got

    def quiet(self, seconds: float) -> None:
        """Nothing comes for `seconds`."""
        with pytest.raises(TimeoutError):
            event = self.next(seconds)
            pytest.fail(f"an event came: {event}")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def summary(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["type"], e["object"]["metadata"]["name"], e["object"]["metadata"]["resourceVersion"]) for e in events]


def list_version(api: FakeApiServer, selector: str = "") -> str:
    status, listed = call(api, "GET", f"{SLICES}?fieldSelector={quote(selector)}" if selector else SLICES)
    assert status == 200
    return str(listed["metadata"]["resourceVersion"])


def test_watch_from_a_list_resource_version(api: FakeApiServer) -> None:
    assert call(api, "POST", SLICES, resource_slice(name="a"))[0] == 201
    rv = list_version(api)
    live = WatchStream(api, f"watch=true&resourceVersion={rv}")
    assert live.status == 200
    assert live.headers["content-type"] == "application/json"
    assert live.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in live.headers
    assert ("GET", live.path, 200) in api.requests

    _, created = call(api, "POST", SLICES, resource_slice(name="b"))
    change = json.loads(json.dumps(created))
    change["spec"]["pool"]["generation"] = 1
    _, updated = call(api, "PUT", f"{SLICES}/b", change)
    # An update that changes nothing still bumps the resourceVersion: MODIFIED again.
    _, same = call(api, "PUT", f"{SLICES}/b", updated)
    assert call(api, "DELETE", f"{SLICES}/b")[0] == 200
    deleted_at = list_version(api)
    expected = [
        ("ADDED", "b", created["metadata"]["resourceVersion"]),
        ("MODIFIED", "b", updated["metadata"]["resourceVersion"]),
        ("MODIFIED", "b", same["metadata"]["resourceVersion"]),
        ("DELETED", "b", deleted_at),
    ]
    with live:
        events = live.events(4)
        assert summary(events) == expected
        assert events[0]["object"] == created
        assert events[1]["object"] == updated
        # DELETED carries the last state, at the deletion's resourceVersion.
        gone = json.loads(json.dumps(same))
        gone["metadata"]["resourceVersion"] = deleted_at
        assert events[3]["object"] == gone
        live.quiet(0.3)

        # A watch from the same resourceVersion, opened afterwards, replays the same events, then goes on live.
        with WatchStream(api, f"watch=1&resourceVersion={rv}") as replay:
            assert summary(replay.events(4)) == expected
            _, c = call(api, "POST", SLICES, resource_slice(name="c"))
            added = ("ADDED", "c", c["metadata"]["resourceVersion"])
            assert summary(replay.events(1)) == [added]
            assert summary(live.events(1)) == [added]
        # From the last event seen, nothing is replayed.
        with WatchStream(api, f"watch=true&resourceVersion={c['metadata']['resourceVersion']}") as resumed:
            resumed.quiet(0.3)


def test_watch_without_resource_version_starts_with_the_current_objects(api: FakeApiServer) -> None:
    for name, node in (("b", "node-a"), ("a", "node-a"), ("c", "node-b")):
        assert call(api, "POST", SLICES, resource_slice(node=node, name=name))[0] == 201
    selector = quote("spec.nodeName=node-a")
    for query in (f"watch=true&fieldSelector={selector}", f"watch=true&resourceVersion=0&fieldSelector={selector}"):
        current = api.slices(node="node-a")
        with WatchStream(api, query) as watch:
            events = watch.events(len(current))
            assert [(e["type"], e["object"]) for e in events] == [("ADDED", s) for s in current]
            watch.quiet(0.2)
            _, d = call(api, "POST", SLICES, resource_slice(node="node-a", name=f"d-{len(api.requests)}"))
            assert summary(watch.events(1)) == [("ADDED", d["metadata"]["name"], d["metadata"]["resourceVersion"])]
    assert [s["metadata"]["name"] for s in api.slices(node="node-a")][:2] == ["a", "b"]


def test_watch_field_selector(api: FakeApiServer) -> None:
    rv = list_version(api)
    mine = quote(f"spec.nodeName=node-a,spec.driver=={DRIVER}")
    with (
        WatchStream(api, f"watch=true&resourceVersion={rv}&fieldSelector={mine}") as watch,
        WatchStream(api, f"watch=true&resourceVersion={rv}&fieldSelector={quote('spec.nodeName!=node-a')}") as others,
        WatchStream(api, f"watch=true&resourceVersion={rv}&fieldSelector={quote('metadata.name=x')}") as named,
    ):
        for name, node, driver in (
            ("x", "node-b", DRIVER),
            ("y", "node-a", "other.example.com"),
            ("z", "node-a", DRIVER),
        ):
            assert call(api, "POST", SLICES, resource_slice(node=node, driver=driver, name=name))[0] == 201
        assert call(api, "DELETE", f"{SLICES}/y")[0] == 200
        assert call(api, "DELETE", f"{SLICES}/z")[0] == 200
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in watch.events(2)] == [
            ("ADDED", "z"),
            ("DELETED", "z"),
        ]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in others.events(1)] == [("ADDED", "x")]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in named.events(1)] == [("ADDED", "x")]
        watch.quiet(0.2)
        others.quiet(0.01)
        named.quiet(0.01)

    with WatchStream(api, f"watch=true&fieldSelector={quote('spec.pool.name=x')}") as bad:
        assert bad.status == 400
        assert_status(bad.body(), 400, "BadRequest")


def test_watch_of_a_node_sees_delete_slices(api: FakeApiServer) -> None:
    for name, node in (("a1", "node-a"), ("a2", "node-a"), ("b1", "node-b")):
        assert call(api, "POST", SLICES, resource_slice(node=node, name=name))[0] == 201
    rv = list_version(api)
    mine = quote(f"spec.nodeName=node-a,spec.driver={DRIVER}")
    with (
        WatchStream(api, f"watch=true&resourceVersion={rv}&fieldSelector={mine}") as watch,
        WatchStream(api, f"watch=true&resourceVersion={rv}&fieldSelector={quote('spec.nodeName=node-b')}") as other,
    ):
        assert api.delete_slices("node-a") == 2
        events = watch.events(2)
        assert {e["type"] for e in events} == {"DELETED"}
        assert sorted(e["object"]["metadata"]["name"] for e in events) == ["a1", "a2"]
        versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert int(rv) < versions[0] < versions[1] == int(list_version(api))
        other.quiet(0.2)

        # The kubelet's wipe: a DeleteCollection by node.
        assert call(api, "POST", SLICES, resource_slice(node="node-a", name="a3"))[0] == 201
        assert call(api, "DELETE", f"{SLICES}?fieldSelector={quote('spec.nodeName=node-a')}")[0] == 200
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in watch.events(2)] == [
            ("ADDED", "a3"),
            ("DELETED", "a3"),
        ]


def test_watch_bookmarks_only_when_allowed(api: FakeApiServer) -> None:
    api.bookmark_seconds = 0.2
    rv = list_version(api)
    with (
        WatchStream(api, f"watch=true&resourceVersion={rv}&allowWatchBookmarks=true") as marked,
        WatchStream(api, f"watch=true&resourceVersion={rv}") as plain,
        WatchStream(api, f"watch=true&resourceVersion={rv}&allowWatchBookmarks=false") as refused,
    ):
        # While idle.
        bookmark = marked.events(1, timeout=2)[0]
        assert bookmark == {
            "type": "BOOKMARK",
            "object": {"kind": "ResourceSlice", "apiVersion": f"{GROUP}/v1", "metadata": {"resourceVersion": rv}},
        }
        # After an event, at a resourceVersion that covers it.
        _, created = call(api, "POST", SLICES, resource_slice(name="s"))
        assert marked.events(1)[0]["type"] == "ADDED"
        after = marked.events(1, timeout=2)[0]
        while after["type"] != "BOOKMARK" or after["object"]["metadata"]["resourceVersion"] == rv:
            after = marked.events(1, timeout=2)[0]
        assert after["object"]["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]

        # Never without allowWatchBookmarks.
        for watch in (plain, refused):
            assert [e["type"] for e in watch.events(1)] == ["ADDED"]
            watch.quiet(0.6)


def test_watch_too_old_resource_version_is_gone(api: FakeApiServer) -> None:
    assert call(api, "POST", SLICES, resource_slice(name="r"))[0] == 201
    rv = list_version(api)
    assert call(api, "POST", SLICES, resource_slice(name="s"))[0] == 201
    with WatchStream(api, f"watch=true&resourceVersion={rv}") as watch:
        assert watch.events(1)[0]["type"] == "ADDED"
    api.compact()
    now = list_version(api)
    with WatchStream(api, f"watch=true&resourceVersion={rv}") as gone:
        assert gone.status == 200
        assert gone.events(1) == [
            {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {rv} ({now})",
                    "reason": "Expired",
                    "code": 410,
                },
            }
        ]
        assert gone.next() is None
        # The body ended cleanly; the connection still serves.
        status, gone.headers = gone.send("GET", SLICES)
        assert status == 200 and [i["metadata"]["name"] for i in gone.body()["items"]] == ["r", "s"]
        # An expired watch is never counted; the first one is gone with its client.
        wait_for(lambda: api.watchers == 0)
    # From the compaction point on, a watch works.
    with WatchStream(api, f"watch=true&resourceVersion={now}") as fresh:
        fresh.quiet(0.2)
        assert call(api, "DELETE", f"{SLICES}/s")[0] == 200
        assert [e["type"] for e in fresh.events(1)] == ["DELETED"]


def test_watch_history_is_bounded(api: FakeApiServer) -> None:
    api.history_limit = 3
    rv = int(list_version(api))
    for i in range(5):
        assert call(api, "POST", SLICES, resource_slice(name=f"s{i}"))[0] == 201
    # rv+1 .. rv+5 written; only the last 3 are kept.
    with WatchStream(api, f"watch=true&resourceVersion={rv + 1}") as old:
        event = old.events(1)[0]
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["message"] == f"too old resource version: {rv + 1} ({rv + 2})"
        assert old.next() is None
    with WatchStream(api, f"watch=true&resourceVersion={rv + 2}") as kept:
        assert [e["object"]["metadata"]["name"] for e in kept.events(3)] == ["s2", "s3", "s4"]


def test_watch_from_a_future_resource_version_waits_for_newer_events(api: FakeApiServer) -> None:
    rv = int(list_version(api))
    with WatchStream(api, f"watch=true&resourceVersion={rv + 2}") as watch:
        for i in range(3):
            assert call(api, "POST", SLICES, resource_slice(name=f"s{i}"))[0] == 201
        assert summary(watch.events(1)) == [("ADDED", "s2", str(rv + 3))]
        watch.quiet(0.2)


def test_watch_bad_requests(api: FakeApiServer) -> None:
    for query in ("watch=true&resourceVersion=abc", "watch=true&resourceVersion=-1", "watch=true&timeoutSeconds=x"):
        with WatchStream(api, query) as watch:
            assert watch.status == 400
            assert_status(watch.body(), 400, "BadRequest")
    with WatchStream(api, "watch=true", token="wrong") as unauthorized:
        assert unauthorized.status == 401
        assert_status(unauthorized.body(), 401, "Unauthorized")
    api.fail_next(1, status=503, reason="ServiceUnavailable")
    with WatchStream(api, "watch=true") as failed:
        assert failed.status == 503
        assert failed.headers["retry-after"] == "1"
        assert_status(failed.body(), 503, "ServiceUnavailable")
    with WatchStream(api, "watch=true") as ok:
        assert ok.status == 200
        wait_for(lambda: api.watchers == 1)
    assert [r[2] for r in api.requests] == [400, 400, 400, 401, 503, 200]
    assert "watch" in call(api, "GET", f"/apis/{GROUP}/v1")[1]["resources"][0]["verbs"]


def test_watch_timeout_seconds_ends_the_stream(api: FakeApiServer) -> None:
    started = time.monotonic()
    with WatchStream(api, "watch=true&timeoutSeconds=1") as watch:
        # Ended by timeoutSeconds: not before it, and long before the wait would give up.
        assert watch.next(timeout=30) is None
        assert 0.9 <= time.monotonic() - started < 10
        # The connection is kept, as the API server keeps it.
        status, watch.headers = watch.send("GET", SLICES)
        assert status == 200 and watch.body()["kind"] == "ResourceSliceList"
    wait_for(lambda: api.watchers == 0)


def test_watchers_and_end_watches(api: FakeApiServer) -> None:
    assert api.watchers == 0
    first = WatchStream(api, "watch=true")
    second = WatchStream(api, "watch=true&allowWatchBookmarks=true")
    assert api.watchers == 2
    # A client that goes away is noticed.
    first.close()
    wait_for(lambda: api.watchers == 1)

    assert api.end_watches() == 1
    assert second.next() is None
    with pytest.raises(EOFError):
        second.next()
    second.close()
    wait_for(lambda: api.watchers == 0)

    # The server goes on serving; a new watch works.
    with WatchStream(api, "watch=true") as third:
        wait_for(lambda: api.watchers == 1)
        assert api.end_watches(clean=False) == 1
        # Cut: the connection closes with the chunked body unfinished.
        with pytest.raises(EOFError):
            third.next()
    wait_for(lambda: api.watchers == 0)
    assert call(api, "GET", SLICES)[0] == 200
    assert api.end_watches() == 0


def test_stop_ends_watches_quickly(api: FakeApiServer) -> None:
    watches = [WatchStream(api, "watch=true"), WatchStream(api, "watch=true&allowWatchBookmarks=true")]
    assert api.watchers == 2
    started = time.monotonic()
    api.stop()
    # Below the 5 s that closing a connection waits for a watch left running.
    assert time.monotonic() - started < 4.0
    for watch in watches:
        with pytest.raises((EOFError, ConnectionResetError)):
            watch.next(timeout=2)
        watch.close()
    assert api.watchers == 0
    assert not [t for t in threading.enumerate() if t.name == "fake-apiserver-conn"]


def test_watch_serves_the_requested_version() -> None:
    with FakeApiServer(versions=("v1beta1", "v1")) as server:
        beta = f"/apis/{GROUP}/v1beta1/resourceslices"
        with (
            WatchStream(server, "watch=true", version="v1beta1") as old,
            WatchStream(server, "watch=true", version="v1") as new,
        ):
            status, created = call(server, "POST", beta, resource_slice(name="s", version="v1beta1"))
            assert status == 201
            assert old.events(1)[0]["object"] == created
            flat = new.events(1)[0]["object"]
            assert flat["apiVersion"] == f"{GROUP}/v1" and flat["kind"] == "ResourceSlice"
            assert flat["spec"]["devices"] == [device("gpu-0")]


# Device taints and dry run.


def taint(key: str = "gpu.nvidia.com/xid", **fields: Any) -> dict[str, Any]:
    return {"key": key, "value": "79", "effect": "NoExecute", **fields}


def tainted(name: str, version: str = "v1", taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    dev = device(name, version)
    (dev["basic"] if version == "v1beta1" else dev)["taints"] = [taint()] if taints is None else taints
    return dev


def taints_of(obj: dict[str, Any]) -> list[Any]:
    """Each device's taints (None where it has none), flat or under basic."""
    return [(d.get("basic") or d).get("taints") for d in obj["spec"]["devices"]]


def causes(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["reason"], c["field"]) for c in body["details"]["causes"]]


def test_a_tainted_slice_holds_at_most_64_devices(api: FakeApiServer) -> None:
    one_tainted = [device(f"gpu-{i}") for i in range(64)] + [tainted("gpu-64")]
    body = invalid(api, resource_slice(devices=one_tainted), "spec.devices")
    assert causes(body) == [("FieldValueTooMany", "spec.devices")]
    assert "must have at most 64 items" in body["message"]
    assert call(api, "POST", SLICES, resource_slice(devices=[tainted(f"gpu-{i}") for i in range(64)]))[0] == 201
    assert call(api, "POST", SLICES, resource_slice(devices=[device(f"gpu-{i}") for i in range(128)]))[0] == 201
    # Consuming counters lowers the limit too.
    counted = [device(f"gpu-{i}") for i in range(65)]
    counted[0]["consumesCounters"] = [{"counterSet": "gpu-0", "counters": {"memory": {"value": "1Gi"}}}]
    assert causes(invalid(api, resource_slice(devices=counted), "spec.devices")) == [
        ("FieldValueTooMany", "spec.devices")
    ]
    assert len(api.slices()) == 2


def test_at_most_16_taints_a_device() -> None:
    many = [taint(f"example.com/t{i}") for i in range(17)]
    with FakeApiServer(versions=("v1", "v1beta1")) as server:
        body = invalid(server, resource_slice(devices=[tainted("gpu-0", taints=many)]), "spec.devices[0].taints")
        assert causes(body) == [("FieldValueTooMany", "spec.devices[0].taints")]
        assert "must have at most 16 items" in body["message"]
        beta = resource_slice(version="v1beta1", devices=[tainted("gpu-0", "v1beta1", many)])
        body = invalid(server, beta, "spec.devices[0].basic.taints", BETA_SLICES)
        assert causes(body) == [("FieldValueTooMany", "spec.devices[0].basic.taints")]

        assert call(server, "POST", SLICES, resource_slice(devices=[tainted("gpu-0", taints=many[:16])]))[0] == 201
        beta = resource_slice(version="v1beta1", devices=[tainted("gpu-0", "v1beta1", many[:16])])
        assert call(server, "POST", BETA_SLICES, beta)[0] == 201


def test_time_added(api: FakeApiServer) -> None:
    offset = "2020-01-01T01:00:00+01:00"
    given = [taint(), taint("example.com/old", timeAdded=OLD), taint("example.com/offset", timeAdded=offset)]
    status, created = call(api, "POST", SLICES, resource_slice(name="s", devices=[tainted("gpu-0", taints=given)]))
    assert status == 201
    set_now, kept, normalized = created["spec"]["devices"][0]["taints"]
    assert TIME.fullmatch(set_now["timeAdded"])
    assert kept["timeAdded"] == OLD
    # Kept as metav1.Time keeps it: in UTC.
    assert normalized["timeAdded"] == OLD
    assert api.slices() == [created]

    # A PUT that leaves timeAdded out resets it to the time of the PUT.
    change = json.loads(json.dumps(created))
    del change["spec"]["devices"][0]["taints"][1]["timeAdded"]
    status, updated = call(api, "PUT", f"{SLICES}/s", change)
    assert status == 200
    reset = updated["spec"]["devices"][0]["taints"][1]["timeAdded"]
    assert TIME.fullmatch(reset) and reset != OLD
    assert updated["metadata"]["generation"] == 2
    # One sent back as read is kept, and the spec is unchanged.
    status, again = call(api, "PUT", f"{SLICES}/s", updated)
    assert status == 200 and taints_of(again) == taints_of(updated)
    assert again["metadata"]["generation"] == 2

    for bad in ("yesterday", "2020-01-01", "2020-01-01 00:00:00Z", "2020-13-01T00:00:00Z", 1577836800):
        obj = resource_slice(devices=[tainted("gpu-0", taints=[taint(timeAdded=bad)])])
        body = invalid(api, obj, "spec.devices[0].taints[0].timeAdded")
        assert causes(body) == [("FieldValueInvalid", "spec.devices[0].taints[0].timeAdded")]
    bad_put = json.loads(json.dumps(again))
    bad_put["spec"]["devices"][0]["taints"][0]["timeAdded"] = "now"
    assert call(api, "PUT", f"{SLICES}/s", bad_put)[0] == 422
    assert api.slices() == [again]


def test_a_server_with_the_gate_off_drops_taints() -> None:
    with FakeApiServer(versions=("v1", "v1beta1"), taints=False) as server:
        status, created = call(server, "POST", SLICES, resource_slice(name="s", devices=[tainted("gpu-0")]))
        assert status == 201
        assert created["spec"]["devices"] == [device("gpu-0")]
        change = json.loads(json.dumps(created))
        change["spec"]["devices"] = [tainted("gpu-0"), tainted("gpu-1")]
        status, updated = call(server, "PUT", f"{SLICES}/s", change)
        assert status == 200
        assert updated["spec"]["devices"] == [device("gpu-0"), device("gpu-1")]

        beta = resource_slice(name="b", version="v1beta1", devices=[tainted("gpu-0", "v1beta1")])
        status, beta_created = call(server, "POST", BETA_SLICES, beta)
        assert status == 201
        assert beta_created["spec"]["devices"] == [device("gpu-0", "v1beta1")]
        beta_created["spec"]["devices"] = [tainted("gpu-0", "v1beta1")]
        status, beta_updated = call(server, "PUT", f"{BETA_SLICES}/b", beta_created)
        assert status == 200
        assert beta_updated["spec"]["devices"] == [device("gpu-0", "v1beta1")]

        # Dropped before validation: the limit of a tainted slice does not apply.
        big = resource_slice(name="big", devices=[tainted(f"gpu-{i}") for i in range(65)])
        status, big_created = call(server, "POST", SLICES, big)
        assert status == 201
        assert taints_of(big_created) == [None] * 65
        assert server.slices() == sorted([updated, beta_updated, big_created], key=lambda o: o["metadata"]["name"])


def test_turning_the_gate_off_keeps_the_taints_already_stored(api: FakeApiServer) -> None:
    _, created = call(api, "POST", SLICES, resource_slice(name="s", devices=[tainted("gpu-0")]))
    api.taints = False
    # In use: an update of a slice that has taints keeps them, new ones too.
    created["spec"]["devices"].append(tainted("gpu-1"))
    status, updated = call(api, "PUT", f"{SLICES}/s", created)
    assert status == 200 and [len(t) for t in taints_of(updated)] == [1, 1]
    # Once none are left, they are dropped again; so they are on a new slice.
    updated["spec"]["devices"] = [device("gpu-0")]
    _, cleared = call(api, "PUT", f"{SLICES}/s", updated)
    cleared["spec"]["devices"] = [tainted("gpu-0")]
    _, dropped = call(api, "PUT", f"{SLICES}/s", cleared)
    assert taints_of(dropped) == [None]
    _, fresh = call(api, "POST", SLICES, resource_slice(devices=[tainted("gpu-0")]))
    assert taints_of(fresh) == [None]
    api.taints = True
    _, kept = call(api, "POST", SLICES, resource_slice(devices=[tainted("gpu-0")]))
    assert len(taints_of(kept)[0]) == 1


def test_dry_run_create(api: FakeApiServer) -> None:
    rv = list_version(api)
    dry = f"{SLICES}?dryRun=All"
    with WatchStream(api, f"watch=true&resourceVersion={rv}") as watch:
        status, answer = call(api, "POST", dry, resource_slice(devices=[tainted("gpu-0")]))
        assert status == 201
        assert answer["apiVersion"] == f"{GROUP}/v1" and answer["kind"] == "ResourceSlice"
        meta = answer["metadata"]
        assert meta["name"].startswith(f"node-a-{DRIVER}-") and meta["name"] != f"node-a-{DRIVER}-"
        assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
        assert not meta.get("resourceVersion")
        assert TIME.fullmatch(taints_of(answer)[0][0]["timeAdded"])
        assert api.slices() == []
        assert list_version(api) == rv
        watch.quiet(0.3)
    assert ("POST", dry, 201) in api.requests

    # Checked as a real write is.
    invalid(api, resource_slice(devices=[tainted(f"gpu-{i}") for i in range(65)]), "spec.devices", dry)
    assert call(api, "POST", SLICES, resource_slice(name="s"))[0] == 201
    status, body = call(api, "POST", dry, resource_slice(name="s"))
    assert status == 409
    assert_status(body, 409, "AlreadyExists")

    # How a driver learns whether the server keeps taints.
    with FakeApiServer(taints=False) as off:
        status, answer = call(off, "POST", dry, resource_slice(devices=[tainted("gpu-0")]))
        assert status == 201 and taints_of(answer) == [None]
        assert off.slices() == []


def test_dry_run_update(api: FakeApiServer) -> None:
    _, created = call(api, "POST", SLICES, resource_slice(name="s"))
    change = json.loads(json.dumps(created))
    change["spec"]["devices"] = [tainted("gpu-0")]
    rv = list_version(api)
    with WatchStream(api, f"watch=true&resourceVersion={rv}") as watch:
        status, answer = call(api, "PUT", f"{SLICES}/s?dryRun=All", change)
        assert status == 200
        assert TIME.fullmatch(taints_of(answer)[0][0]["timeAdded"])
        assert answer["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
        assert answer["metadata"]["generation"] == 2
        assert api.slices() == [created]
        assert list_version(api) == rv
        watch.quiet(0.3)

    stale = json.loads(json.dumps(change))
    stale["metadata"]["resourceVersion"] = "1" + rv
    assert call(api, "PUT", f"{SLICES}/s?dryRun=All", stale)[0] == 409
    change["spec"]["nodeName"] = "node-b"
    assert call(api, "PUT", f"{SLICES}/s?dryRun=All", change)[0] == 422
    assert api.slices() == [created]


def test_dry_run_bad_value(api: FakeApiServer) -> None:
    _, created = call(api, "POST", SLICES, resource_slice(name="s"))
    for value in ("x", "all", "", "All&dryRun=x"):
        # As the API server validates CreateOptions and UpdateOptions: 422, not a write.
        for method, path, kind in (("POST", SLICES, "CreateOptions"), ("PUT", f"{SLICES}/s", "UpdateOptions")):
            status, body = call(api, method, f"{path}?dryRun={value}", created if method == "PUT" else resource_slice())
            assert status == 422, body
            assert_status(body, 422, "Invalid")
            assert body["details"]["kind"] == kind and body["details"]["group"] == "meta.k8s.io"
            assert causes(body) == [("FieldValueNotSupported", "dryRun")]
            assert 'supported values: "All"' in body["message"]
    assert api.slices() == [created]


def test_edit_slice(api: FakeApiServer) -> None:
    _, created = call(api, "POST", SLICES, resource_slice(name="s"))
    rv = created["metadata"]["resourceVersion"]

    def add_taint(obj: dict[str, Any]) -> None:
        obj["spec"]["devices"][0]["taints"] = [taint("example.com/admin", effect="NoSchedule")]

    with WatchStream(api, f"watch=true&resourceVersion={rv}") as watch:
        edited = api.edit_slice("s", add_taint)
        assert int(edited["metadata"]["resourceVersion"]) > int(rv)
        assert edited["metadata"]["generation"] == 2
        assert TIME.fullmatch(taints_of(edited)[0][0]["timeAdded"])
        assert api.slices() == [edited]
        events = watch.events(1)
        assert summary(events) == [("MODIFIED", "s", edited["metadata"]["resourceVersion"])]
        assert events[0]["object"] == edited

    # The driver's copy is stale now.
    status, body = call(api, "PUT", f"{SLICES}/s", created)
    assert status == 409
    assert_status(body, 409, "Conflict")

    with pytest.raises(ApiError) as refused:
        api.edit_slice("s", lambda obj: obj["spec"].update(nodeName="node-b"))
    assert refused.value.code == 422 and "spec.nodeName" in refused.value.message
    with pytest.raises(KeyError):
        api.edit_slice("ghost", add_taint)
    assert api.slices() == [edited]


def test_edit_slice_in_its_stored_version() -> None:
    with FakeApiServer(versions=("v1", "v1beta1")) as server:
        assert call(server, "POST", BETA_SLICES, resource_slice(name="s", version="v1beta1"))[0] == 201

        def add_taint(obj: dict[str, Any]) -> None:
            assert obj["apiVersion"] == f"{GROUP}/v1beta1"
            obj["spec"]["devices"][0]["basic"]["taints"] = [taint()]

        edited = server.edit_slice("s", add_taint)
        assert edited["apiVersion"] == f"{GROUP}/v1beta1" and len(taints_of(edited)[0]) == 1
        status, as_v1 = call(server, "GET", f"{SLICES}/s")
        assert status == 200 and as_v1["spec"]["devices"][0]["taints"] == taints_of(edited)[0]

        # With the gate off, an edit's new taints are dropped as a PUT's are.
        assert call(server, "POST", SLICES, resource_slice(name="t"))[0] == 201
        server.taints = False
        assert taints_of(server.edit_slice("t", lambda obj: obj["spec"]["devices"][0].update(taints=[taint()]))) == [
            None
        ]
