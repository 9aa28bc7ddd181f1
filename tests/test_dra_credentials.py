"""nvplug.dra.kubeconfig resolved: auto, kubelet (the node's own identity) or a path; the kubelet's rotated
client certificate picked up at the next connection."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.admission_policies import node_user
from support.apiserver_standin import GROUP, FakeApiServer
from support.dra_kubelet_standin import DraKubelet
from test_dra import dra_device
from test_dra_e2e import DRIVER, NODE, Dra, serving
from test_dra_tls import make_cert, tls_front, write_kubeconfig

from nvplug.config.model import DraConfig
from nvplug.dra.api_client import ApiClient, KubeConfigError
from nvplug.dra.dra_credentials import chosen, load_kubeconfig
from nvplug.dra.slice_publisher import SlicePublisher
from nvplug.status import status_client
from nvplug.testing.simulated_node import SimulatedNode


def test_auto_is_nvplugs_own_kubeconfig_where_it_exists_else_the_kubelets(tmp_path: Path) -> None:
    own = tmp_path / "nvplug-kubeconfig"
    kubelet = write_kubeconfig(tmp_path / "kubelet.conf", "https://10.0.0.1:6443", {"token": "t"})
    dra = DraConfig(kubelet_kubeconfig=str(kubelet))
    assert dra.kubeconfig == "auto"
    assert chosen(dra, own) == "kubelet"  # a new install on a node: the node's own identity
    own.write_text("")
    assert chosen(dra, own) == str(own)  # an operator's kubeconfig is kept
    assert chosen(replace(dra, kubeconfig="kubelet"), own) == "kubelet"
    assert chosen(replace(dra, kubeconfig="/etc/other"), own) == "/etc/other"
    own.unlink()
    # Neither: nvplug's own path, whose absence the error names as before.
    assert chosen(replace(dra, kubelet_kubeconfig=str(tmp_path / "none")), own) == str(own)


def test_the_kubelets_identity_is_its_kubeconfig_with_its_current_certificate(tmp_path: Path) -> None:
    kubelet = write_kubeconfig(tmp_path / "kubelet.conf", "https://10.0.0.1:6443", {"token": "bootstrap"})
    pem = tmp_path / "pki" / "kubelet-client-current.pem"
    dra = DraConfig(kubeconfig="kubelet", kubelet_kubeconfig=str(kubelet), kubelet_certificate=str(pem))
    # No certificate yet (a kubelet that authenticates otherwise): its kubeconfig's user.
    config = load_kubeconfig(dra)
    assert (config.server, config.token, config.cert_file) == ("https://10.0.0.1:6443", "bootstrap", None)
    pem.parent.mkdir()
    pem.write_text("")
    config = load_kubeconfig(dra)
    assert (config.token, config.cert_file, config.key_file) == (None, str(pem), str(pem))
    assert str(pem) in config.source
    missing = replace(dra, kubelet_kubeconfig=None)
    if not any(Path(p).exists() for p in ("/etc/kubernetes/kubelet.conf", "/var/lib/kubelet/kubeconfig")):
        with pytest.raises(KubeConfigError, match=r"no kubelet kubeconfig is at /etc/kubernetes/kubelet\.conf"):
            load_kubeconfig(missing)


class KubeletPki:
    """A CA, a server certificate, and two client pairs of node-a as the kubelet keeps them: one PEM per
    pair, kubelet-client-current.pem a symlink to the newest."""

    def __init__(self, directory: Path) -> None:
        self.ca = make_cert(directory, "ca")
        self.server_key, self.server_cert = make_cert(directory, "server", self.ca)
        self.dir = directory / "pki"
        self.dir.mkdir()
        for name in ("system:node:node-a-1", "system:node:node-a-2"):
            key, cert = make_cert(directory, name, self.ca)
            (self.dir / f"{name}.pem").write_bytes(cert.read_bytes() + key.read_bytes())
        self.current = self.dir / "kubelet-client-current.pem"
        self.current.symlink_to(self.dir / "system:node:node-a-1.pem")

    def rotate(self) -> None:
        """The second pair made current, as the kubelet does: a new symlink renamed over the old."""
        swap = self.dir / "swap"
        swap.symlink_to(self.dir / "system:node:node-a-2.pem")
        swap.replace(self.current)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_rotated_kubelet_certificate_is_used_from_the_next_connection(tmp_path: Path) -> None:
    pki = KubeletPki(tmp_path)
    clients: list[str] = []

    async def main(api: FakeApiServer) -> None:
        async with tls_front(api, pki.server_key, pki.server_cert, client_ca=pki.ca[1], clients=clients) as port:
            kubelet = write_kubeconfig(
                tmp_path / "kubelet.conf",
                f"https://127.0.0.1:{port}",
                {"client-certificate": str(pki.current), "client-key": str(pki.current)},
                {"certificate-authority": str(pki.ca[1])},
            )
            dra = DraConfig(kubeconfig="kubelet", kubelet_kubeconfig=str(kubelet), kubelet_certificate=str(pki.current))
            client = ApiClient(load_kubeconfig(dra), timeout=5.0)
            assert (await client.request("GET", f"/apis/{GROUP}"))["name"] == GROUP
            # The kubelet rotates: a new pair, the symlink moved. The open connection goes on; the next one,
            # after the server closed this one (a watch's end, an idle timeout), shows the new certificate.
            pki.rotate()
            assert (await client.request("GET", f"/apis/{GROUP}"))["name"] == GROUP
            await client.close()
            assert (await client.request("GET", f"/apis/{GROUP}"))["name"] == GROUP
            await client.close()

    with FakeApiServer(token=None) as api:
        asyncio.run(main(api))
    assert clients == ["system:node:node-a-1", "system:node:node-a-2"], clients


@pytest.fixture
def as_node(node: SimulatedNode) -> Iterator[Dra]:
    """The daemon with the node's own identity: a token the stand-in holds to the Node authorizer's rules."""
    api = FakeApiServer(versions=("v1",), netns=node.netns, users={"node-a-token": node_user(NODE)})
    api.start()
    served = serving(node, api, DraKubelet(node.root / "registry", NODE, "1.36", api))
    dra = next(served)
    api.write_kubeconfig(dra.kubeconfig, token="node-a-token")
    try:
        yield dra
    finally:
        served.close()


def reserved_claim(dra: Dra, name: str, device: str, pod: str) -> tuple[str, str, str]:
    """An allocated claim of `device`, reserved for pod ml/`pod`."""
    uid = f"uid-{name}"
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    dra.api.add_claim({
        "metadata": {"namespace": "ml", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": {"devices": {"results": [result]}},
                   "reservedFor": [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}]},
    })  # fmt: skip
    return ("ml", name, uid)


def test_the_daemon_speaking_as_its_node_needs_nothing_the_node_authorizer_refuses(as_node: Dra) -> None:
    dra = as_node
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool, written as the node")
    dra.wait(lambda: bool(status_client.status(f"unix:{dra.node.status_socket}")["dra"]["watching"]), "the watch")
    # Its watch (field selector spec.nodeName) sees an admin's delete, and the slice is written back.
    dra.api.delete_slices(NODE)
    dra.wait(lambda: len(dra.pool()) == 4, "the pool written back")
    # A claim of a pod bound to this node is read and prepared; one of a pod bound elsewhere is refused to it.
    dra.api.bind_pod("ml", "train-0", NODE)
    dra.api.bind_pod("ml", "elsewhere-0", "node-b")
    ours = reserved_claim(dra, "train", "gpu-5", "train-0")
    theirs = reserved_claim(dra, "other", "gpu-6", "elsewhere-0")
    answers = dra.kubelet.prepare(DRIVER, [ours, theirs])
    assert answers[ours[2]].error == "", answers
    assert "no relationship found between node and this object" in answers[theirs[2]].error, answers
    # Every request the daemon made passed, but that one claim's read.
    refused = [r for r in list(dra.api.requests) if r[2] in (401, 403)]
    assert refused and all(r[1].endswith("/resourceclaims/other") for r in refused), refused
    print(f"as system:node:{NODE}: {len(dra.api.requests)} requests, refused: {refused}")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_rotation_under_an_open_watch_is_taken_when_the_watch_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The publisher's watch is a connection of its own, open for minutes: when it ends (here the API server
    restarts), the watch and the writes after it show the new certificate, with one line in the log."""
    pki = KubeletPki(tmp_path)
    clients: list[str] = []

    async def until(check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 15
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def main(api: FakeApiServer) -> None:
        async with tls_front(api, pki.server_key, pki.server_cert, client_ca=pki.ca[1], clients=clients) as port:
            kubelet = write_kubeconfig(
                tmp_path / "kubelet.conf", f"https://127.0.0.1:{port}", {}, {"certificate-authority": str(pki.ca[1])}
            )
            dra = DraConfig(kubeconfig="kubelet", kubelet_kubeconfig=str(kubelet), kubelet_certificate=str(pki.current))
            client = ApiClient(load_kubeconfig(dra), timeout=5.0)
            publisher = SlicePublisher(client, DRIVER, NODE)
            task = asyncio.create_task(publisher.run())
            try:
                publisher.want([dra_device(i) for i in range(2)])
                await until(lambda: publisher.published and publisher.watching, "published and watching")
                pki.rotate()
                first = len(clients)
                await asyncio.to_thread(api.restart)
                await until(lambda: "system:node:node-a-2" in clients[first:], "a connection with the new one")
                publisher.want([dra_device(i) for i in range(3)])
                await until(lambda: len(api.slices(node=NODE)[0]["spec"]["devices"]) == 3, "a write after it")
                await until(lambda: publisher.watching and publisher.published, "watching again")
                assert set(clients[first:]) == {"system:node:node-a-2"}, clients
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await client.close()

    with caplog.at_level("WARNING", logger="nvplug.dra"), FakeApiServer(token=None) as api:
        asyncio.run(main(api))
    said = [r.getMessage() for r in caplog.records]
    print(f"connections: {clients}; the log: {said}")
    assert len(said) <= 1, said
