"""The nodes package: the one owner of `nodes`, `atoms`, `host_resources`, node sessions, desired
state, `node_reports` and `report_sequences`. Others call these functions; none writes those
tables (tests/test_layering.py checks it).

Modules: `queries` (every statement, by name), `registry` (registering, listing, enrolment's node
rows, revoked marks), `health` (cordon, GPU health), `connectivity` (liveness, the unreachable
sweep, the operator's override), `inventory` (Hello and Inventory applied), `sessions` (a node's
newest session), `desired` (its desired state: bump, read), `reports` (node reports: intake, and
the reservation worker's verdicts).

One lock rule (controlplane.common.locks): the node's pool lock before its rows, for every change
that affects placement. Entry points that take a pool open one transaction; those that take a
connection run in the caller's.
"""
