"""The requests about the node's ResourceSlices other than the publisher's writes: which API version to
speak, the node's slices listed, and the dry runs (which store nothing and reach no watcher) that ask what
the API server would do: keep a device taint, take another node's slice."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from nvplug.config import TaintEffect
from nvplug.dra.api_client import ApiClient, ApiError
from nvplug.dra.device_taints import UNMONITORED_KEY, Taint, kept
from nvplug.dra.resource_slices import GROUP, VERSIONS, slices

# A node name no node has (doctor's dry run of another node's slice).
OTHER_NODE = "nvplug-doctor-no-such-node"
# What a server that does not take a taint answers a dry run with: BadRequest, Invalid.
REFUSED = (400, 422)


async def discover(client: ApiClient) -> str:
    """The newest resource.k8s.io version the API server serves (and nvplug writes)."""
    group = await client.request("GET", f"/apis/{GROUP}")
    served = {v.get("version") for v in group.get("versions") or [] if isinstance(v, dict)}
    version = next((v for v in VERSIONS if v in served), None)
    if version is None:
        raise ValueError(f"the API server serves {GROUP} {sorted(map(str, served))}, none of {list(VERSIONS)}")
    return version


async def probe_taints(client: ApiClient, version: str, node: str, driver: str) -> tuple[bool, bool]:
    """(whether the API server keeps device taints, whether it takes the effect None), asked by dry runs
    that store nothing: discovery cannot tell, since a server with the gate off serves the field and
    drops it on write, and the effect None came after the field (1.35). A server that refuses the
    taint itself (400, 422) keeps none."""

    async def keeps(effect: TaintEffect) -> bool | None:
        taints = {"taints": [Taint(UNMONITORED_KEY, "", effect).as_object()]}
        device: dict[str, Any] = {"name": "taint-probe", **({"basic": taints} if version == "v1beta1" else taints)}
        (probe,) = slices([device], driver, node, 0, version)
        try:
            answer = await client.request("POST", f"/apis/{GROUP}/{version}/resourceslices?dryRun=All", probe)
        except ApiError as err:
            if err.status in REFUSED:
                return None
            raise
        return kept([device], (answer.get("spec") or {}).get("devices") or [])

    if not await keeps("NoSchedule"):
        return False, False
    return True, bool(await keeps("None"))


async def writes_other_nodes(client: ApiClient, version: str, driver: str) -> tuple[bool | None, str]:
    """Whether these credentials may create another node's ResourceSlice, asked by a dry run (it stores nothing
    and reaches no watcher) for a node that does not exist: (True, that node) where it was accepted, (False,
    the refusal) where authorization or admission refused it (the Node authorizer's NodeRestriction, a VAP),
    (None, why) where the API server gave no verdict (it failed, or did not answer)."""
    device: dict[str, Any] = {"name": "probe", **({"basic": {}} if version == "v1beta1" else {})}
    (probe,) = slices([device], driver, OTHER_NODE, 0, version)
    try:
        await client.request("POST", f"/apis/{GROUP}/{version}/resourceslices?dryRun=All", probe)
    except ApiError as err:
        return (False if err.status in (403, *REFUSED) else None), str(err)
    except (OSError, TimeoutError) as err:
        return None, str(err) or type(err).__name__
    return True, OTHER_NODE


async def list_slices(client: ApiClient, version: str, node: str, driver: str) -> list[dict[str, Any]]:
    """The node's ResourceSlices of this driver, by name."""
    return (await list_slices_at(client, version, node, driver))[0]


async def list_slices_at(
    client: ApiClient, version: str, node: str, driver: str
) -> tuple[list[dict[str, Any]], str | None]:
    """The node's ResourceSlices of this driver, by name, and the list's resourceVersion (a watch's start)."""
    selector = quote(f"spec.nodeName={node},spec.driver={driver}")
    listed = await client.request("GET", f"/apis/{GROUP}/{version}/resourceslices?fieldSelector={selector}")
    items = sorted(listed.get("items") or [], key=lambda s: str(s["metadata"]["name"]))
    version_at = (listed.get("metadata") or {}).get("resourceVersion")
    return items, str(version_at) if version_at else None
