"""The embedded policy decision point: Cedar policies per tenant (cedarpy).

IAM is never called inside a database transaction: callers read the policy and the attributes in
one transaction, call `decide` outside it, and act on the decision in another.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import cedarpy

from controlplane import errors
from controlplane.auth import Caller

CREATE = "compute:reservations:create"
READ = "compute:reservations:read"
LIST = "compute:reservations:list"
EXTEND = "compute:reservations:extend"
RELEASE = "compute:reservations:release"

ALLOW = "allow"
DENY = "deny"
CONFIRM = "confirm"


@dataclass(frozen=True)
class Decision:
    outcome: str  # allow, deny or confirm
    reasons: tuple[str, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.outcome == ALLOW


class PolicyTooDeep(Exception):
    """A stored policy nests deeper than the parser can be trusted with: never evaluated."""


class PolicyCache:
    """Parsed policy sets by (tenant, SHA-256 of the policy text): a tenant's policy is parsed once
    per version, not at every decision. Least recently used entries leave first beyond `entries`."""

    def __init__(self, entries: int, max_nesting: int = 64) -> None:
        self.entries = max(1, entries)
        self.max_nesting = max_nesting  # deeper text is never handed to the parser (it could crash it)
        self.parses = 0  # policy texts parsed so far
        self._sets: OrderedDict[tuple[str, bytes], cedarpy.PolicySet] = OrderedDict()

    def get(self, tenant_id: str, text: str) -> cedarpy.PolicySet:
        key = (tenant_id, hashlib.sha256(text.encode()).digest())
        found = self._sets.get(key)
        if found is not None:
            self._sets.move_to_end(key)
            return found
        if nesting_depth(text) > self.max_nesting:  # stored before PutPolicy checked it
            raise PolicyTooDeep(f"the tenant's policy nests brackets deeper than {self.max_nesting}")
        parsed = cedarpy.PolicySet.from_str(text)
        self.parses += 1
        self._sets[key] = parsed
        while len(self._sets) > self.entries:
            self._sets.popitem(last=False)
        return parsed


POLICIES = PolicyCache(1024)  # sized from Settings.policy_cache_entries when the server starts


def validate_policy(text: str, max_nesting: int = 64) -> None:
    """Raise INVALID_INPUT unless `text` parses as a Cedar policy set nesting brackets at most
    `max_nesting` deep (checked first: a deeper text could crash the parser)."""
    depth = nesting_depth(text)
    if depth > max_nesting:
        raise errors.InvalidInput("cedar", f"brackets nest {depth} deep; at most {max_nesting}")
    try:
        policies = cedarpy.policies_to_json_str(text)
    except Exception as exc:  # cedarpy raises ValueError with the parser's message
        raise errors.InvalidInput("cedar", f"not a valid Cedar policy set: {exc}") from None
    if policies is None:
        raise errors.InvalidInput("cedar", "not a valid Cedar policy set")


def nesting_depth(text: str) -> int:
    """How deep (, [ and { nest in Cedar text, outside string literals and // comments."""
    depth = deepest = i = 0
    while i < len(text):
        c = text[i]
        if c == '"':  # a string literal, with backslash escapes
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth -= 1
        i += 1
    return deepest


_PLAIN = frozenset({bool, int, str})  # passed to Cedar as they are


def _cedar_value(value: Any) -> Any:
    if isinstance(value, bool) or isinstance(value, int) or isinstance(value, str):
        return value
    if isinstance(value, float):
        return {"__extn": {"fn": "decimal", "arg": f"{value:.4f}"}}
    if isinstance(value, dict):
        return {k: v if type(v) in _PLAIN else _cedar_value(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_cedar_value(v) for v in value]
    raise TypeError(f"no Cedar value for {type(value).__name__}")


def decide(
    policy: str | None,
    caller: Caller,
    action: str,
    resource_type: str,
    resource_id: str,
    attributes: dict[str, Any],
    *,
    tenant_id: str,
    approved: bool = False,
) -> Decision:
    """Decide `action` by `caller` on a resource with `attributes` under the tenant's policy.

    No policy means deny (Cedar's default). A delegated agent is refused whatever its person is
    refused. A delegated agent refused an action its person holds for confirmation gets CONFIRM;
    once the person approved this exact request, the decision is made on the person's authority
    instead of the agent's.
    """
    if policy is None:
        return _refusal(caller, action, ("the tenant has no policy",))
    try:
        policies = _policies(tenant_id, policy)
    except PolicyTooDeep as exc:  # stored before PutPolicy checked nesting: refused, never parsed
        return Decision(DENY, (str(exc),))
    if caller.delegated and not approved:
        # An agent acts for its person and never beyond: the person must be allowed the same call
        # on its own authority, or the agent is refused outright (no confirmation: the person could
        # only approve it into its own refusal).
        person = _authorize(policies, caller.delegator_id or "", caller.delegator_kind, action, resource_type,
                            resource_id, attributes, _person_context(tenant_id))
        if person.decision != cedarpy.Decision.Allow:
            return Decision(DENY, ("the person the agent acts for is refused this call",))
    principal_id = caller.delegator_id if (approved and caller.delegator_id) else caller.identity_id
    context = _context(caller, tenant_id, approved=approved)
    kind = caller.delegator_kind if principal_id != caller.identity_id else caller.kind
    result = _authorize(policies, principal_id, kind, action, resource_type, resource_id, attributes, context)
    if result.decision == cedarpy.Decision.Allow:
        return Decision(ALLOW, tuple(result.diagnostics.reasons))
    detail = tuple(result.diagnostics.errors) or tuple(result.diagnostics.reasons)
    if approved:  # decided on the person's authority: nobody is left to confirm it
        return Decision(DENY, detail)
    return _refusal(caller, action, detail)


def _authorize(policies: cedarpy.PolicySet | str, principal_id: str, kind: str, action: str, resource_type: str,
               resource_id: str, attributes: dict[str, Any], context: dict[str, Any]) -> Any:
    """Cedar's answer for one principal. Entity references go as `{"type", "id"}` objects, not
    Cedar text Cedar would parse again at each call, and the entities as one JSON text."""
    entities = json.dumps([_principal(principal_id, kind), _resource(resource_type, resource_id, attributes)])
    return cedarpy.is_authorized(_request(principal_id, action, resource_type, resource_id, context), policies,
                                 entities)


def allowed_each(policy: str | None, caller: Caller, action: str, resource_type: str,
                 resources: list[tuple[str, dict[str, Any]]], *, tenant_id: str) -> list[bool]:
    """Whether `decide` would allow `action` on each of `resources` ((id, attributes) pairs), in one
    Cedar batch (a listing's items: a call per item costs about twice as much). Nothing is held
    for confirmation here: a refused agent is refused."""
    if policy is None or not resources:
        return [False] * len(resources)
    try:
        policies = _policies(tenant_id, policy)
    except PolicyTooDeep:
        return [False] * len(resources)
    principals = [(caller.identity_id, caller.kind, _context(caller, tenant_id, approved=False))]
    if caller.delegated:  # the person must be allowed each one on its own authority too
        principals.append((caller.delegator_id or "", caller.delegator_kind, _person_context(tenant_id)))
    entities = [_principal(p, kind) for p, kind, _ in principals]
    entities += [_resource(resource_type, rid, attributes) for rid, attributes in resources]
    requests = [_request(p, action, resource_type, rid, context) for p, _, context in principals
                for rid, _ in resources]
    results = cedarpy.is_authorized_batch(requests, policies, json.dumps(entities))
    n = len(resources)
    return [all(results[k * n + i].decision == cedarpy.Decision.Allow for k in range(len(principals)))
            for i in range(n)]


def _policies(tenant_id: str, policy: str) -> cedarpy.PolicySet | str:
    """The parsed policy set (PolicyTooDeep if it nests too deep); a text stored before validation
    existed is handed to Cedar as text, which refuses it with its diagnostics."""
    try:
        return POLICIES.get(tenant_id, policy)
    except ValueError:
        return policy


def _context(caller: Caller, tenant_id: str, *, approved: bool) -> dict[str, Any]:
    return {"tenantId": tenant_id, "delegated": caller.delegated and not approved, "confirmed": approved,
            "agentId": caller.identity_id if caller.delegated else ""}


def _person_context(tenant_id: str) -> dict[str, Any]:
    """The context of a delegated agent's person deciding on its own authority."""
    return {"tenantId": tenant_id, "delegated": False, "confirmed": False, "agentId": ""}


def _principal(principal_id: str, kind: str) -> dict[str, Any]:
    return {"uid": {"type": "Identity", "id": principal_id}, "attrs": {"kind": kind}, "parents": []}


def _resource(resource_type: str, resource_id: str, attributes: dict[str, Any]) -> dict[str, Any]:
    return {"uid": {"type": resource_type, "id": resource_id}, "attrs": _cedar_value(attributes), "parents": []}


def _request(principal_id: str, action: str, resource_type: str, resource_id: str,
             context: dict[str, Any]) -> dict[str, Any]:
    """Entity references go as `{"type", "id"}` objects, not Cedar text Cedar would parse again."""
    return {"principal": {"type": "Identity", "id": principal_id}, "action": {"type": "Action", "id": action},
            "resource": {"type": resource_type, "id": resource_id}, "context": _cedar_value(context)}




def _refusal(caller: Caller, action: str, reasons: tuple[str, ...]) -> Decision:
    if caller.delegated and action in caller.confirm_actions:
        return Decision(CONFIRM, reasons)
    return Decision(DENY, reasons)
