"""nodesim/cdischema.py, the project's own check of CDI spec files: what it accepts and refuses,
and, where the upstream CDI JSON schema and its examples are checked out beside the repository
(../shared/cdi), that the two agree on every example and on the hand-made bad specs here."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from nodesim import cdischema

UPSTREAM = Path(__file__).resolve().parents[2] / "shared" / "cdi"

GOOD: dict[str, Any] = {
    "cdiVersion": "0.6.0",
    "kind": "bcd.dev/gpu.mig",
    "annotations": {"bcd.dev/allocation-id": "alloc_1"},
    "devices": [
        {"name": "GPU-0a1b:3", "annotations": {"x": "y"},
         "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "permissions": "rw",
                                             "major": 195, "minor": 0, "uid": 0, "gid": 0}]}},
        {"name": "0", "containerEdits": {"env": ["A=1"]}},
    ],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=GPU-0a1b", "EMPTY="],
        "deviceNodes": [{"path": "/dev/nvidiactl"}],
        "mounts": [{"hostPath": "/usr/lib/libcuda.so", "containerPath": "/usr/lib/libcuda.so",
                    "options": ["ro", "bind"]}],
        "hooks": [{"hookName": "createContainer", "path": "/usr/bin/ldconfig", "args": ["ldconfig"],
                   "timeout": 10}],
        "netDevices": [{"hostInterfaceName": "eth1", "name": "net1"}],
        "additionalGids": [44],
    },
}


def edited(path: str, value: Any) -> dict[str, Any]:
    """GOOD with the value at a dotted path (list indexes as numbers) replaced; DELETE removes it."""
    document = copy.deepcopy(GOOD)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    target: Any = document
    for key in parents:
        target = target[key]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return document


DELETE = object()

# (document, a fragment of the problem it must be refused with, does the upstream schema refuse it too)
BAD: dict[str, tuple[Any, str, bool]] = {
    "not an object": ([], "JSON object", True),
    "empty object": ({}, "'cdiVersion' is required", True),
    "no cdiVersion": (edited("cdiVersion", DELETE), "'cdiVersion' is required", True),
    "no kind": (edited("kind", DELETE), "'kind' is required", True),
    "no devices": (edited("devices", DELETE), "'devices' is required", True),
    "kind not a string": (edited("kind", 7), "$.kind: must be a string", True),
    "devices not a list": (edited("devices", {}), "$.devices: must be a list", True),
    "device without a name": (edited("devices.1.name", DELETE), "$.devices[1]: 'name' is required", True),
    "device without edits": (edited("devices.1.containerEdits", DELETE), "'containerEdits' is required", True),
    "device node without a path": (edited("devices.0.containerEdits.deviceNodes.0.path", DELETE),
                                   "deviceNodes[0]: 'path' is required", True),
    "device node uid negative": (edited("devices.0.containerEdits.deviceNodes.0.uid", -1), ".uid: must be", True),
    "mount without containerPath": (edited("containerEdits.mounts.0.containerPath", DELETE),
                                    "mounts[0]: 'containerPath' is required", True),
    "hook without a path": (edited("containerEdits.hooks.0.path", DELETE), "hooks[0]: 'path' is required", True),
    "hook timeout too big": (edited("containerEdits.hooks.0.timeout", 2**32), ".timeout: must be", True),
    "annotation not a string": (edited("annotations", {"a": 1}), "$.annotations.a: must be a string", True),
    "device annotation not a string": (edited("devices.0.annotations", {"a": ["b"]}), "must be a string", True),
    "net device without a name": (edited("containerEdits.netDevices.0.name", DELETE), "'name' is required", True),
    "gid not an integer": (edited("containerEdits.additionalGids", ["44"]), "additionalGids[0]", True),
    # Stricter than the upstream schema, from the specification's text and pkg/parser:
    "kind without a class": (edited("kind", "bcd.dev"), "vendor/class", False),
    "kind class ends with a dot": (edited("kind", "bcd.dev/gpu."), "class 'gpu.'", False),
    "kind vendor starts with a digit": (edited("kind", "1bcd.dev/gpu"), "vendor '1bcd.dev'", False),
    "kind with a space": (edited("kind", "bcd.dev/g pu"), "class 'g pu'", False),
    "device name with a slash": (edited("devices.0.name", "../x"), "'../x' is not a device name", False),
    "device name ends with a colon": (edited("devices.0.name", "GPU-0:"), "is not a device name", False),
    "empty device name": (edited("devices.0.name", ""), "'' is not a device name", False),
    "device named twice": (edited("devices.1.name", "GPU-0a1b:3"), "named twice", False),
    "no devices at all": (edited("devices", []), "at least one device", False),
    "device with empty edits": (edited("devices.1.containerEdits", {"env": []}), "at least one container edit",
                                False),
    "cdiVersion not a version": (edited("cdiVersion", "latest"), "semantic version", False),
    "env entry without =": (edited("containerEdits.env", ["NOVALUE"]), "is not NAME=value", False),
    "env entry not a string": (edited("containerEdits.env", [1]), "env[0]: must be a string", False),
    "relative device path": (edited("containerEdits.deviceNodes.0.path", "dev/nvidiactl"), "absolute", False),
    "unknown device type": (edited("devices.0.containerEdits.deviceNodes.0.type", "x"), "not one of b, c", False),
    "unknown permission": (edited("devices.0.containerEdits.deviceNodes.0.permissions", "rwx"), "r, w, m", False),
    "unknown hook name": (edited("containerEdits.hooks.0.hookName", "whenever"), "'whenever' is not one of", False),
    "empty annotation key": (edited("annotations", {"": "v"}), "keys must not be empty", False),
}


def test_a_spec_with_every_kind_of_container_edit_is_valid() -> None:
    assert cdischema.problems(GOOD) == []
    minimal = {"cdiVersion": "0.3.0", "kind": "vendor.com/device",
               "devices": [{"name": "myDevice", "containerEdits": {"deviceNodes": [{"path": "/dev/card1"}]}}]}
    assert cdischema.problems(minimal) == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_spec_is_refused_naming_what_is_wrong(case: str) -> None:
    document, fragment, _ = BAD[case]
    found = cdischema.problems(document)
    assert any(fragment in p for p in found), found


def test_every_problem_is_reported_not_only_the_first() -> None:
    document = edited("kind", "nope")
    document["devices"][0]["name"] = "-bad"
    document["containerEdits"]["env"] = ["x"]
    assert len(cdischema.problems(document)) == 3


# Agreement with the upstream schema --------------------------------------------------------


def upstream_validator() -> Any:
    if not (UPSTREAM / "schema.json").is_file():
        pytest.skip("the upstream CDI schema is not checked out beside the repository (../shared/cdi)")
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    defs = Resource.from_contents(json.loads((UPSTREAM / "defs.json").read_text()), default_specification=DRAFT7)
    schema = json.loads((UPSTREAM / "schema.json").read_text())
    return jsonschema.Draft7Validator(schema, registry=Registry().with_resources([("defs.json", defs)]))


def _upstream_refuses(validator: Any, text: str) -> bool:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return True
    return any(True for _ in validator.iter_errors(document))


def _ours_refuses(text: str) -> bool:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return True
    return cdischema.problems(document) != []


def test_the_module_agrees_with_the_upstream_schema_on_its_examples_and_our_bad_specs() -> None:
    validator = upstream_validator()
    examples = sorted(UPSTREAM.glob("good-*.json")) + sorted(UPSTREAM.glob("bad-*.json"))
    assert [p for p in examples if p.name.startswith("good-")] and [p for p in examples if p.name.startswith("bad-")]
    for path in examples:
        text = path.read_text()
        want_refused = path.name.startswith("bad-")
        assert _upstream_refuses(validator, text) == want_refused, path.name
        assert _ours_refuses(text) == want_refused, path.name
    assert not _upstream_refuses(validator, json.dumps(GOOD))
    for case, (document, _, upstream_too) in BAD.items():
        text = json.dumps(document)
        assert _ours_refuses(text), case
        # Where the upstream schema speaks, it says the same; the rest is ours alone (the name,
        # version and hook rules of the specification's text, which its schema leaves out).
        assert _upstream_refuses(validator, text) == upstream_too, case
