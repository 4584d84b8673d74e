"""The Container Device Interface spec file format, checked in plain code from the CDI
specification (SPEC.md, cdiVersion up to 0.6.0) and its name rules (pkg/parser), so the project
validates the CDI specs it writes without anything from outside the repository.

`problems(document)` lists what is wrong with a parsed spec file ([] when it is valid):

- required: `cdiVersion` (a semantic version), `kind` (`vendor/class`), `devices` (a non-empty
  list; each with a `name` and non-empty `containerEdits`); device names unique;
- names: vendor and class start with a letter, end with a letter or digit, and hold only letters,
  digits, `_`, `-`, `.`; a device name starts and ends with a letter or digit and may also hold
  `_`, `-`, `.`, `:`;
- container edits: `env` entries `NAME=value`; `deviceNodes` (`path` required, absolute; `type`
  one of b, c, u, p; `permissions` of r, w, m; numbers in range); `mounts` (`hostPath` and
  `containerPath` required); `hooks` (`hookName` one of the OCI hook names, `path` required);
  `netDevices`, `additionalGids`, `intelRdt` typed;
- `annotations` (spec and device): a map of non-empty string keys to string values.

It is at least as strict as the upstream JSON schema (schema/schema.json), which leaves names,
versions and hook names unchecked; tests/test_cdischema.py pins the two to agree where both speak.
"""

from __future__ import annotations

import re
from typing import Any

VERSION = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
# pkg/parser: validateVendorOrClassName and ValidateDeviceName.
VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
ENV = re.compile(r"^[^=\x00]+=")
HOOK_NAMES = frozenset({"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"})
DEVICE_TYPES = frozenset({"b", "c", "u", "p"})
PERMISSIONS = re.compile(r"^[rwm]*$")
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)

_EDIT_LISTS = ("env", "deviceNodes", "netDevices", "mounts", "hooks", "additionalGids")


def problems(document: Any) -> list[str]:
    """Everything wrong with a parsed CDI spec file, each as `where: what`; [] when valid."""
    out: list[str] = []
    if not isinstance(document, dict):
        return ["$: a CDI spec is a JSON object"]
    for key in ("cdiVersion", "kind", "devices"):
        if key not in document:
            out.append(f"$: {key!r} is required")
    if "cdiVersion" in document:
        _string(out, "$.cdiVersion", document["cdiVersion"], VERSION, "a semantic version like 0.6.0")
    if "kind" in document:
        _kind(out, document["kind"])
    if "annotations" in document:
        _annotations(out, "$.annotations", document["annotations"])
    if "devices" in document:
        _devices(out, document["devices"])
    if "containerEdits" in document:
        _edits(out, "$.containerEdits", document["containerEdits"], need_some=False)
    return out


def _string(out: list[str], where: str, value: Any, pattern: re.Pattern[str] | None = None, what: str = "") -> bool:
    if not isinstance(value, str):
        out.append(f"{where}: must be a string")
        return False
    if pattern is not None and not pattern.match(value):
        out.append(f"{where}: {value!r} is not {what}")
        return False
    return True


def _kind(out: list[str], kind: Any) -> None:
    if not _string(out, "$.kind", kind):
        return
    vendor, slash, cls = kind.partition("/")
    if not slash:
        out.append(f"$.kind: {kind!r} is not of the form vendor/class")
        return
    for part, value in (("vendor", vendor), ("class", cls)):
        if not VENDOR_OR_CLASS.match(value):
            out.append(f"$.kind: {part} {value!r} must start with a letter, end with a letter or digit"
                       " and hold only letters, digits, '_', '-', '.'")


def _annotations(out: list[str], where: str, value: Any) -> None:
    if not isinstance(value, dict):
        out.append(f"{where}: must be an object of strings")
        return
    for key, item in value.items():
        if not key:
            out.append(f"{where}: keys must not be empty")
        if not isinstance(item, str):
            out.append(f"{where}.{key}: must be a string")


def _devices(out: list[str], devices: Any) -> None:
    if not isinstance(devices, list):
        out.append("$.devices: must be a list")
        return
    if not devices:
        out.append("$.devices: must name at least one device")
    seen: set[str] = set()
    for i, device in enumerate(devices):
        where = f"$.devices[{i}]"
        if not isinstance(device, dict):
            out.append(f"{where}: must be an object")
            continue
        for key in ("name", "containerEdits"):
            if key not in device:
                out.append(f"{where}: {key!r} is required")
        name = device.get("name")
        if "name" in device and _string(out, f"{where}.name", name, DEVICE_NAME,
                                        "a device name (letters, digits, '_', '-', '.', ':';"
                                        " starts and ends with a letter or digit)"):
            if name in seen:
                out.append(f"{where}.name: {name!r} is named twice")
            seen.add(name)
        if "annotations" in device:
            _annotations(out, f"{where}.annotations", device["annotations"])
        if "containerEdits" in device:
            _edits(out, f"{where}.containerEdits", device["containerEdits"], need_some=True)


def _edits(out: list[str], where: str, edits: Any, *, need_some: bool) -> None:
    if not isinstance(edits, dict):
        out.append(f"{where}: must be an object")
        return
    for key in _EDIT_LISTS:
        if key in edits and not isinstance(edits[key], list):
            out.append(f"{where}.{key}: must be a list")
    lists = {key: edits[key] for key in _EDIT_LISTS if isinstance(edits.get(key), list)}
    if need_some and not any(lists.values()) and not edits.get("intelRdt"):
        out.append(f"{where}: a device needs at least one container edit")
    for i, env in enumerate(lists.get("env", [])):
        _string(out, f"{where}.env[{i}]", env, ENV, "NAME=value")
    for i, node in enumerate(lists.get("deviceNodes", [])):
        _device_node(out, f"{where}.deviceNodes[{i}]", node)
    for i, mount in enumerate(lists.get("mounts", [])):
        _fields(out, f"{where}.mounts[{i}]", mount, required=("hostPath", "containerPath"),
                strings=("hostPath", "containerPath", "type"), string_lists=("options",))
    for i, hook in enumerate(lists.get("hooks", [])):
        here = f"{where}.hooks[{i}]"
        if _fields(out, here, hook, required=("hookName", "path"), strings=("hookName", "path"),
                   string_lists=("args", "env"), numbers={"timeout": UINT32}):
            if isinstance(hook.get("hookName"), str) and hook["hookName"] not in HOOK_NAMES:
                out.append(f"{here}.hookName: {hook['hookName']!r} is not one of {sorted(HOOK_NAMES)}")
    for i, net in enumerate(lists.get("netDevices", [])):
        _fields(out, f"{where}.netDevices[{i}]", net, required=("hostInterfaceName", "name"),
                strings=("hostInterfaceName", "name"))
    for i, gid in enumerate(lists.get("additionalGids", [])):
        _number(out, f"{where}.additionalGids[{i}]", gid, UINT32)
    if "intelRdt" in edits:
        _fields(out, f"{where}.intelRdt", edits["intelRdt"], strings=("closID", "l3CacheSchema", "memBwSchema"),
                string_lists=("schemata",), booleans=("enableMonitoring",))


def _device_node(out: list[str], where: str, node: Any) -> None:
    if not _fields(out, where, node, required=("path",), strings=("path", "hostPath", "permissions", "type"),
                   numbers={"major": INT64, "minor": INT64, "uid": UINT32, "gid": UINT32}):
        return
    path = node.get("path")
    if isinstance(path, str) and not path.startswith("/"):
        out.append(f"{where}.path: {path!r} is not an absolute path")
    if isinstance(node.get("type"), str) and node["type"] not in DEVICE_TYPES:
        out.append(f"{where}.type: {node['type']!r} is not one of b, c, u, p")
    if isinstance(node.get("permissions"), str) and not PERMISSIONS.match(node["permissions"]):
        out.append(f"{where}.permissions: {node['permissions']!r} holds more than r, w, m")


def _fields(out: list[str], where: str, value: Any, *, required: tuple[str, ...] = (), strings: tuple[str, ...] = (),
            string_lists: tuple[str, ...] = (), booleans: tuple[str, ...] = (),
            numbers: dict[str, tuple[int, int]] | None = None) -> bool:
    """Check an object's fields by type; False when it is not an object at all."""
    if not isinstance(value, dict):
        out.append(f"{where}: must be an object")
        return False
    for key in required:
        if key not in value:
            out.append(f"{where}: {key!r} is required")
    for key in strings:
        if key in value:
            _string(out, f"{where}.{key}", value[key])
    for key in string_lists:
        if key in value and (not isinstance(value[key], list) or not all(isinstance(s, str) for s in value[key])):
            out.append(f"{where}.{key}: must be a list of strings")
    for key in booleans:
        if key in value and not isinstance(value[key], bool):
            out.append(f"{where}.{key}: must be true or false")
    for key, bounds in (numbers or {}).items():
        if key in value:
            _number(out, f"{where}.{key}", value[key], bounds)
    return True


def _number(out: list[str], where: str, value: Any, bounds: tuple[int, int]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not bounds[0] <= value <= bounds[1]:
        out.append(f"{where}: must be an integer in [{bounds[0]}, {bounds[1]}]")
