"""ValidatingAdmissionPolicies as the API server applies them, for the API-server stand-in: loaded from a
manifest as shipped (with their bindings), their CEL evaluated by cel-python with the variables the API
server gives (`request`, `object`, `oldObject`). Only what nvplug's manifest uses: resourceRules,
matchConditions, validations and a Deny binding."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import yaml


@dataclasses.dataclass(frozen=True)
class User:
    """An authenticated user, as `request.userInfo` shows it."""

    name: str
    groups: tuple[str, ...] = ("system:authenticated",)

    @property
    def node(self) -> str | None:
        """The node whose kubelet this is (`system:node:<name>` in `system:nodes`); None: not a node."""
        prefix = "system:node:"
        if not self.name.startswith(prefix) or "system:nodes" not in self.groups:
            return None
        return self.name.removeprefix(prefix)


@dataclasses.dataclass(frozen=True)
class Denied:
    policy: str
    message: str


class _Policy:
    def __init__(self, doc: Mapping[str, Any]) -> None:
        env = celpy.Environment()
        spec = doc["spec"]
        self.name = str(doc["metadata"]["name"])
        self.rules = list(spec["matchConstraints"]["resourceRules"])
        self.conditions = [env.program(env.compile(c["expression"])) for c in spec.get("matchConditions") or []]
        self.validations = [
            (env.program(env.compile(v["expression"])), str(v.get("message") or v["expression"]))
            for v in spec["validations"]
        ]

    def applies(self, group: str, resource: str, operation: str) -> bool:
        return any(
            group in r.get("apiGroups", []) and resource in r.get("resources", []) and operation in r["operations"]
            for r in self.rules
        )


class AdmissionPolicies:
    """The bound policies of the manifests loaded."""

    def __init__(self) -> None:
        self._policies: list[_Policy] = []

    def load(self, manifest: Path) -> None:
        docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
        bound = {
            d["spec"]["policyName"]
            for d in docs
            if d["kind"] == "ValidatingAdmissionPolicyBinding" and "Deny" in d["spec"]["validationActions"]
        }
        policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
        self._policies += [_Policy(d) for d in policies if d["metadata"]["name"] in bound]

    def check(
        self,
        user: User,
        group: str,
        resource: str,
        operation: str,
        new: Mapping[str, Any] | None,
        old: Mapping[str, Any] | None,
    ) -> Denied | None:
        """The first validation that fails for this request; None: admitted."""
        activation = {
            "request": celpy.json_to_cel(
                {"operation": operation, "userInfo": {"username": user.name, "groups": list(user.groups)}}
            ),
            "object": celpy.json_to_cel(new),
            "oldObject": celpy.json_to_cel(old),
        }
        for policy in self._policies:
            if not policy.applies(group, resource, operation):
                continue
            # A condition that cannot be evaluated matches (failurePolicy Fail): the validations decide.
            if not all(_true(c, activation, error=True) for c in policy.conditions):
                continue
            for program, message in policy.validations:
                if not _true(program, activation, error=False):
                    return Denied(policy.name, message)
        return None


def node_user(node: str) -> User:
    """The kubelet of `node`, as the Node authorizer knows it."""
    return User(f"system:node:{node}", ("system:nodes", "system:authenticated"))


def _true(program: celpy.Runner, activation: dict[str, Any], error: bool) -> bool:
    """Whether the expression is the boolean true; `error`: what an evaluation error counts as."""
    try:
        value = program.evaluate(activation)
    except celpy.CELEvalError:
        return error
    return isinstance(value, celpy.celtypes.BoolType) and bool(value)
