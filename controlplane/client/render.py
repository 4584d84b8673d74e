"""Output: JSON as the spec shows its objects for scripts, tables and short summaries for people (rich)."""

from __future__ import annotations

import json
import sys
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console, Group
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from bettercompute.v1 import capacity_pb2 as cpb
from bettercompute.v1 import events_pb2 as epb
from bettercompute.v1 import nodes_pb2 as npb
from bettercompute.v1 import reservations_pb2 as pb
from bettercompute.v1 import usage_pb2 as upb
from controlplane.client.times import fmt_duration, fmt_time
from controlplane.durations import parse_duration_ms

BAR_WIDTH = 40
M = TypeVar("M", bound=Message)
STATE_STYLES = {
    "placed": "cyan", "binding": "yellow", "active": "green", "pending": "yellow", "queued": "yellow",
    "awaiting-confirmation": "magenta", "approved": "green", "rejected": "red", "released": "dim", "cancelled": "dim", "expired": "dim",
    "denied": "red", "failed": "red",
}


def as_json(message: Message) -> dict[str, Any]:
    """The answer as the spec shows its objects: camelCase, 64-bit integers as JSON numbers
    (`"start": 1790000000000`, `"version": 4`, not the protobuf mapping's strings), and fields
    without presence kept at their zero value (`"conditions": []`, `"booked": 0`, `"fits": false`)
    rather than left out; an optional field that is not set (`leaseDeadline`) stays absent."""
    return MessageToDict(message, preserving_proto_field_name=False, always_print_fields_with_no_presence=True,
                         unquote_int64_if_possible=True)


class Output:
    """Where answers go: JSON (`--json`, or stdout is not a terminal) or human on the terminal."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode
        # No markup: text from the API is drawn as it reads, never obeyed as "[link=…]".
        self.out = Console(highlight=False, soft_wrap=False, markup=False)
        self.err = Console(stderr=True, highlight=False, markup=False)

    @classmethod
    def choose(cls, force_json: bool) -> Output:
        return cls(force_json or not sys.stdout.isatty())

    def show(self, message: Message) -> None:
        if self.json_mode:
            print(json.dumps(as_json(message), indent=2))
            return
        message = printable(message)
        render = _RENDERERS.get(type(message))
        self.out.print(render(message) if render else json.dumps(as_json(message), indent=2))

    def event(self, event: epb.Event) -> None:
        if self.json_mode:
            print(json.dumps(as_json(event)), flush=True)  # one line per event
            return
        event = printable(event)
        data = MessageToDict(event.data)
        extra = "  ".join(f"{k}={v}" for k, v in sorted(data.items()) if k in ("state", "reason", "poolId"))
        line = Text.assemble(
            (fmt_time(event.time, seconds=True), "dim"), "  ", (f"#{event.id}", "bold"), "  ",
            (event.type, "cyan"), "  ", event.subject, ("  " + extra if extra else ""),
        )
        self.out.print(line, soft_wrap=True)  # one event, one line

    def error(self, error: dict[str, Any]) -> None:
        if self.json_mode:
            print(json.dumps(error, indent=2), file=sys.stderr)
            return
        body = error["error"]
        self.err.print(Text.assemble(("error ", "bold red"), (body["code"], "bold"), f": {_safe(body['message'])}"))
        details = body.get("details", {})
        for key, value in sorted(details.items()):
            self.err.print(f"  {_safe(key)}: {_safe(value)}")
        if body["code"] == "CONFIRMATION_REQUIRED" and details.get("confirmationId"):
            self.err.print(
                f"Your person must approve it: better-compute confirmations approve {details['confirmationId']}\n"
                "then run the same command again (with the same --key and window)."
            )

    @contextmanager
    def progress(self, what: str) -> Iterator[Callable[[str], None]]:
        """A spinner with the state and elapsed time on a terminal; nothing otherwise."""
        if self.json_mode or not self.out.is_terminal:
            yield lambda state: None
            return
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=self.out, transient=True) as bar:
            task = bar.add_task(f"{what}: submitted")
            yield lambda state: bar.update(task, description=f"{what}: {state}")


def _safe(text: str) -> str:
    """`text` with its control characters spelled out (`\\x1b`): what a node or another caller
    wrote must not reach a terminal as escape sequences (clear the screen, retitle it, a link)."""
    return "".join(f"\\x{ord(ch):02x}" if unicodedata.category(ch) == "Cc" else ch for ch in text)


def printable(message: M) -> M:
    """A copy of `message` whose every string (nested, repeated, map keys and values) is `_safe`."""
    copy = type(message)()
    copy.CopyFrom(message)
    _clean(copy)
    return copy


def _clean(message: Message) -> None:
    for field, value in message.ListFields():
        if field.type == field.TYPE_STRING:
            if field.is_repeated:
                value[:] = [_safe(v) for v in value]
            else:
                setattr(message, field.name, _safe(value))
        elif field.type != field.TYPE_MESSAGE:
            continue
        elif field.message_type.GetOptions().map_entry:
            entries = list(value.items())
            value.clear()
            for key, item in entries:
                key = _safe(key) if isinstance(key, str) else key
                if isinstance(item, Message):
                    value[key].CopyFrom(item)
                    _clean(value[key])
                else:
                    value[key] = _safe(item) if isinstance(item, str) else item
        elif field.is_repeated:
            for item in value:
                _clean(item)
        else:
            _clean(value)


def _state(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def _devices(request: pb.StoredRequest) -> str:
    return ", ".join(
        f"{d.count} × {d.device_class}" + (f" {d.profile}" if d.profile else "")
        + (f" ({d.topology})" if d.topology else "") for d in request.devices
    )


def _window(during: pb.Interval) -> str:
    if not during.start and not during.end:
        return "not booked yet"
    same_day = fmt_time(during.start)[:10] == fmt_time(during.end)[:10]
    end = fmt_time(during.end, with_date=False) + fmt_time(during.end)[16:] if same_day else fmt_time(during.end)
    return f"{fmt_time(during.start)} → {end} ({fmt_duration(during.end - during.start)})"


def _summary(heading: Text | Group, rows: list[tuple[str, Any]]) -> Group:
    """A heading line, then `label  value` rows."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, value in rows:
        grid.add_row(label, value)
    return Group(heading, grid)


def _reservation_rows(r: pb.Reservation) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [("pool", r.pool_id), ("devices", _devices(r.request))]
    if r.request.HasField("gang"):
        key = r.request.gang.topology_key
        rows.append(("gang", f"{r.request.gang.size} nodes" + (f" sharing one {key}" if key else "")))
    if r.spot:
        rows.append(("spot", "yes: preemptible after the pool's notice"))
    if r.during.end:
        rows.append(("window", _window(r.during)))
    else:
        rows.append(("duration", fmt_duration(_duration_ms(r.request.duration))))
    if r.HasField("lease_deadline"):
        rows.append(("lease", f"until {fmt_time(r.lease_deadline)}"))
    res = r.request.resources
    if res.vcpu or res.memory_gib or res.hugepages_1gi:
        host = f"{res.vcpu} vCPUs, {res.memory_gib} GiB" + (f", {res.hugepages_1gi} x 1 GiB huge pages"
                                                           if res.hugepages_1gi else "")
        rows.append(("host", host + f" per node (share {r.host_share.vcpu} vCPUs, {r.host_share.memory_gib} GiB)"))
    rows += [("owner", r.owner_identity_id), ("key", r.idempotency_key)]
    for a in r.allocations:
        rows.append(("allocation", f"{a.id} on {a.node_id}: {len(a.device_ids)} GPUs, {a.state}"))
    if r.binding.node_id:
        bound = f"{len(r.binding.cdi_devices)} CDI devices on {r.binding.node_id}"
        bound += (", attested" if r.binding.attested else "") + (f", {r.binding.env_file}" if r.binding.env_file else "")
        bound += f", cgroup {r.binding.cgroup_parent}" if r.binding.cgroup_parent else ""
        rows.append(("binding", bound))
    for c in r.conditions:
        rows.append(("condition", f"{c.type}={c.status} {c.reason}: {c.message}".rstrip(": ")))
    return rows


def _heading(r: pb.Reservation) -> Text:
    return Text.assemble((r.id, "bold"), "  ", _state(r.state))


def reservation(r: pb.Reservation) -> Group:
    return _summary(_heading(r), _reservation_rows(r))


def _duration_ms(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ValueError:
        return 0


def reservation_list(page: pb.ListReservationsResponse) -> Table:
    table = Table(box=None, header_style="bold", caption=f"next page: --cursor {page.next_cursor}" if page.next_cursor else None)
    # On a narrow terminal the ids give way (cut with an ellipsis), never the state, size or window.
    for column in ("ID", "STATE", "GPUS", "START", "DURATION", "POOL"):
        table.add_column(column, no_wrap=column not in ("ID", "POOL"), overflow="ellipsis")
    for r in page.items:
        gpus = str(sum(d.count for d in r.request.devices))
        start = fmt_time(r.during.start) if r.during.start else "-"
        length = r.during.end - r.during.start if r.during.end else _duration_ms(r.request.duration)
        table.add_row(r.id, _state(r.state), gpus, start, fmt_duration(length), r.pool_id)
    if not page.items:
        table.caption = "no reservations"
    return table


def extended(answer: pb.ExtendReservationResponse) -> Group:
    r = answer.reservation
    rows = _reservation_rows(r)
    if answer.extended:
        rows.append(("extended", Text(f"yes, now until {fmt_time(r.during.end)}", style="green")))
    else:
        why = (f"another booking starts at {fmt_time(answer.available_until)}"
               if answer.HasField("available_until") else "it already reaches that time")
        rows.append(("extended", Text(f"no: {why}", style="yellow")))
    return _summary(_heading(r), rows)


def confirmation(c: pb.Confirmation) -> Group:
    rows: list[tuple[str, Any]] = [
        ("reservation", c.reservation_id),
        ("action", c.action),
        ("agent", f"{c.agent_identity_id} for {c.person_identity_id}"),
    ]
    if c.HasField("until"):  # an extend: the end the person is asked to approve
        rows.append(("new end", fmt_time(c.until)))
    if c.expires_at:
        rows.append(("expires", fmt_time(c.expires_at)))
    return _summary(Text.assemble((c.id, "bold"), "  ", _state(c.state)), rows)


def timeline(t: cpb.TimelineResponse) -> Group:
    """A calendar: one row per bucket, booked GPUs as a solid bar, free ones as a light one."""
    scale = min(1.0, BAR_WIDTH / t.allocatable) if t.allocatable else 1.0
    width = round(t.allocatable * scale)  # every row as wide: the pool's allocatable GPUs
    title = f"{t.pool_id}: {t.allocatable} GPUs allocatable"
    if t.buckets:
        title += f", {fmt_duration(t.buckets[0].end - t.buckets[0].start)} per row"
    table = Table(box=None, header_style="bold")
    table.add_column("FROM", no_wrap=True)
    table.add_column("BOOKED ■ / FREE □", no_wrap=True)
    table.add_column("BOOKED", justify="right")
    table.add_column("FREE", justify="right")
    previous_day = ""
    for b in t.buckets:
        stamp = fmt_time(b.start)
        day, clock = stamp[:10], stamp[11:]
        label = f"{day} {clock}" if day != previous_day else f"{'':10} {clock}"
        previous_day = day
        booked = round(b.booked * scale)
        bar = Text.assemble(("█" * booked, "red"), ("░" * max(0, width - booked), "green"))
        table.add_row(label, bar, str(b.booked), str(b.free))
    return Group(Text(title, style="bold"), table)


def rollup(r: cpb.RollupResponse) -> Group:
    """The pool's whole GPUs now, for the pool and per model, and who uses them."""
    table = Table(box=None, header_style="bold")
    for name, justify in (("MODEL", "left"), ("ALLOCATABLE", "right"), ("IN USE", "right"),
                          ("RESERVED", "right"), ("FREE", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for m in r.models:
        c = m.counts
        table.add_row(m.model, str(c.allocatable), str(c.in_use), str(c.reserved), str(c.free))
    t = r.total
    table.add_row(Text("all", style="bold"), str(t.allocatable), str(t.in_use), str(t.reserved), str(t.free))
    lines = [Text(f"{r.pool_id}: {t.free} of {t.allocatable} GPUs free now", style="bold"), table,
             Text(f"this tenant: {r.own_in_use} in use, {r.own_reserved} reserved; "
                  f"others: {r.others_in_use} in use, {r.others_reserved} reserved")]
    if r.tenants:
        per = Table(box=None, header_style="bold")
        for name in ("TENANT", "IN USE", "RESERVED"):
            per.add_column(name, justify="left" if name == "TENANT" else "right", no_wrap=True)
        for u in r.tenants:
            per.add_row(u.tenant_id, str(u.in_use), str(u.reserved))
        lines.append(per)
    return Group(*lines)


def preview(p: cpb.PreviewResponse) -> Group:
    """Where the reservation would go, or why nothing fits, filter by filter."""
    if not p.fits:
        table = Table(box=None, header_style="bold")
        for name in ("FILTER", "NODES", "REASON"):
            table.add_column(name, justify="right" if name == "NODES" else "left")
        for f in p.filters:
            table.add_row(f.filter, str(f.nodes), f.reason)
        return Group(Text("does not fit", style="bold red"), Text(p.reason), table)
    rows = [("window", f"{fmt_time(p.start)} → {fmt_time(p.end)}")]
    if p.group:
        rows.append(("group", p.group))
    if p.HasField("resources"):
        rows.append(("host", f"{p.resources.vcpu} vcpu, {p.resources.memory_gib} GiB memory per node"))
    for m in p.members:
        rows.append(("node", f"{m.node_name or m.node_id}: {', '.join(m.device_ids)}"))
    return _summary(Text("fits", style="bold green"), rows)


def usage(u: upb.QueryUsageResponse) -> Group:
    """One row per metered hour: hour, meter, subject, quantity, pool and region."""
    table = Table(box=None, header_style="bold")
    for name, justify in (("HOUR", "left"), ("METER", "left"), ("SUBJECT", "left"), ("QUANTITY", "right"),
                          ("POOL", "left"), ("REGION", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for r in u.items:
        table.add_row(fmt_time(r.hour), r.meter, r.subject, f"{r.quantity:.4f}", r.pool_id, r.region)
    return Group(table, Text(f"total {u.total:.4f}", style="bold"))


def join_token(t: npb.JoinToken) -> Group:
    """The secret alone on its line (to copy), then what it is good for and until when."""
    left = fmt_duration(t.expires_at - int(time.time() * 1000))
    rows = [("node", t.node_name), ("role", t.role), ("pool", t.pool_id),
            ("expires", f"{fmt_time(t.expires_at)} (in {left}), or once used")]
    heading = Group(Text("join token (shown once, only its hash is kept):", style="bold"), Text(t.secret, no_wrap=True))
    return _summary(heading, rows)


def node_certificates(page: npb.ListNodeCertificatesResponse) -> Table:
    """A node's certificates, newest first (the PEM only with --json)."""
    table = Table(box=None, header_style="bold", caption=None if page.items else "no certificates")
    for name in ("SERIAL", "USAGE", "ROLE", "NOT AFTER", "REVOKED"):
        table.add_column(name, no_wrap=name != "SERIAL", overflow="fold")
    for c in page.items:
        table.add_row(c.serial, c.usage, c.role, fmt_time(c.not_after), fmt_time(c.revoked_at) if c.revoked else "-")
    return table


def revoked(answer: npb.RevokeCertificatesResponse) -> Group:
    if not answer.serials:
        return Group(Text("nothing revoked: already revoked", style="yellow"))
    return Group(Text(f"revoked {len(answer.serials)} certificates:", style="bold"),
                 *(Text(f"  {serial}") for serial in answer.serials))


def readmitted(answer: npb.ReadmitNodeResponse) -> Text:
    if answer.readmitted:
        return Text("readmitted: the node may enrol again with a new join token", style="green")
    return Text("not revoked: nothing changed", style="yellow")


_RENDERERS: dict[type, Callable[[Any], Any]] = {
    pb.Reservation: reservation,
    pb.ListReservationsResponse: reservation_list,
    pb.ExtendReservationResponse: extended,
    pb.Confirmation: confirmation,
    cpb.TimelineResponse: timeline,
    cpb.RollupResponse: rollup,
    cpb.PreviewResponse: preview,
    upb.QueryUsageResponse: usage,
    npb.JoinToken: join_token,
    npb.ListNodeCertificatesResponse: node_certificates,
    npb.RevokeCertificatesResponse: revoked,
    npb.ReadmitNodeResponse: readmitted,
}
