"""The shipped ValidatingAdmissionPolicy (packaging/kubernetes/nvplug-node-identity.yaml), as written, held
by the API-server stand-in against nvplug's API client: a member of nvplug:nodes writes only its own node's
slices of nvplug's driver; a user outside the group is not judged by it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.admission_policies import User
from support.apiserver_standin import GROUP, FakeApiServer
from test_dra_e2e import NODE_IDENTITY_MANIFEST

from nvplug.dra.api_client import ApiClient, ApiError, KubeConfig
from nvplug.dra.resource_slices import slices

NODE_A = User("nvplug:node:node-a", ("nvplug:nodes", "system:authenticated"))
# Not in the group: an operator with its own rights (RBAC is not the stand-in's), not the policy's business.
OPERATOR = User("alice", ("system:authenticated",))
BASE = f"/apis/{GROUP}/v1/resourceslices"


def slice_of(node: str, driver: str = "gpu.nvidia.com", name: str | None = None) -> dict[str, Any]:
    (obj,) = slices([{"name": "gpu-0"}], driver, node, 1, "v1")
    if name is not None:
        obj["metadata"] = {"name": name}
    return obj


@pytest.fixture
def api(tmp_path: Any) -> Any:
    server = FakeApiServer(versions=("v1",), users={"node-a": NODE_A, "operator": OPERATOR})
    server.admission.load(NODE_IDENTITY_MANIFEST)
    with server:
        yield server


def client(api: FakeApiServer, tmp_path: Any, token: str) -> ApiClient:
    return ApiClient(KubeConfig.load(api.write_kubeconfig(tmp_path / f"{token}.kubeconfig", token=token)), timeout=5)


async def refusal(call: Any) -> str:
    """The message of the refusal `call` meets; empty: it was admitted."""
    try:
        await call
    except ApiError as err:
        assert err.status == 422, err
        return str(err)
    return ""


def test_a_member_of_nvplug_nodes_writes_only_its_own_nodes_slices(api: FakeApiServer, tmp_path: Any) -> None:
    node_a, operator = client(api, tmp_path, "node-a"), client(api, tmp_path, "operator")

    async def main() -> None:
        # Its own slice: created, updated, deleted (a dry run is judged alike, and stores nothing).
        assert await refusal(node_a.request("POST", f"{BASE}?dryRun=All", slice_of("node-a", name="dry"))) == ""
        assert await refusal(node_a.request("POST", BASE, slice_of("node-a", name="a"))) == ""
        own = api.slices(node="node-a")[0]
        assert await refusal(node_a.request("PUT", f"{BASE}/a", own)) == ""
        # Another node's: not created, not changed, not deleted.
        assert "may write only the ResourceSlices of the node in its user name" in await refusal(
            node_a.request("POST", BASE, slice_of("node-b", name="b-by-a"))
        )
        assert await refusal(operator.request("POST", BASE, slice_of("node-b", name="b"))) == ""
        theirs = api.slices(node="node-b")[0]
        assert "may write only the ResourceSlices of the node in its user name" in await refusal(
            node_a.request("PUT", f"{BASE}/b", theirs)
        )
        assert "may change or delete only the ResourceSlices of the node in its user name" in await refusal(
            node_a.request("DELETE", f"{BASE}/b")
        )
        # Moving its own slice to another node: the new object is refused (the field is immutable besides).
        moved = {**own, "spec": {**own["spec"], "nodeName": "node-b"}}
        assert "may write only the ResourceSlices of the node" in await refusal(
            node_a.request("PUT", f"{BASE}/a", moved)
        )
        # Another driver's slice, even of its own node.
        assert "only the ResourceSlices of nvplug's driver, gpu.nvidia.com" in await refusal(
            node_a.request("POST", BASE, slice_of("node-a", driver="other.example.com", name="x"))
        )
        assert await refusal(node_a.request("DELETE", f"{BASE}/a")) == ""
        await node_a.close()
        await operator.close()

    asyncio.run(main())
    assert [s["metadata"]["name"] for s in api.slices()] == ["b"]
