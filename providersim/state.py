"""The simulated provider's state: accounts' reservations and instances, in memory.

Provider semantics (as GCE): a running instance created into a reservation uses one of its slots;
a stopped instance uses none; a reservation whose total drops below its running instances keeps
them running; a deleted reservation leaves its instances running, no longer reserved.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


class ProviderError(Exception):
    """A refusal of the provider's API: `kind` is not-found, invalid, exhausted or conflict."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Reservation:
    account: str
    name: str
    flavor: str
    region: str
    total: int
    state: str = "ready"


@dataclass
class Instance:
    account: str
    name: str
    flavor: str
    region: str
    reservation: str
    state: str
    created_at: int


def _now_ms() -> int:
    return int(time.time() * 1000)


class Provider:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reservations: dict[tuple[str, str], Reservation] = {}
        self.instances: dict[tuple[str, str], Instance] = {}

    def in_use(self, account: str, name: str) -> int:
        return sum(1 for i in self.instances.values()
                   if i.account == account and i.reservation == name and i.state == "running")

    def put_reservation(self, account: str, name: str, flavor: str, region: str, total: int,
                        state: str = "ready") -> Reservation:
        if not account or not name or total < 0:
            raise ProviderError("invalid", "account, name and a total of at least 0 are required")
        with self._lock:
            found = self.reservations.get((account, name))
            if found is None:
                if not flavor:
                    raise ProviderError("invalid", "a new reservation needs a flavor")
                found = self.reservations[(account, name)] = Reservation(account, name, flavor, region, total,
                                                                         state or "ready")
            else:
                found.total = total
                found.state = state or found.state
            return found

    def delete_reservation(self, account: str, name: str) -> Reservation:
        with self._lock:
            found = self.reservations.pop((account, name), None)
            if found is None:
                raise ProviderError("not-found", f"no reservation {name}")
            for instance in self.instances.values():
                if instance.account == account and instance.reservation == name:
                    instance.reservation = ""  # no longer reserved: on demand from now on
            return found

    def list_reservations(self, account: str) -> list[Reservation]:
        with self._lock:
            return sorted((r for r in self.reservations.values() if r.account == account), key=lambda r: r.name)

    def create_instance(self, account: str, name: str, flavor: str, region: str, reservation: str) -> Instance:
        if not account or not name or not flavor:
            raise ProviderError("invalid", "account, name and flavor are required")
        with self._lock:
            found = self.instances.get((account, name))
            if found is not None and found.state != "deleted":
                if found.flavor != flavor or found.reservation != reservation:
                    raise ProviderError("conflict", f"instance {name} exists with another flavor or reservation")
                return found
            if reservation:
                self._take_slot(account, reservation, flavor)
            instance = Instance(account, name, flavor, region, reservation, "running", _now_ms())
            self.instances[(account, name)] = instance
            return instance

    def _take_slot(self, account: str, reservation: str, flavor: str) -> None:
        found = self.reservations.get((account, reservation))
        if found is None:
            raise ProviderError("not-found", f"no reservation {reservation}")
        if found.flavor != flavor:
            raise ProviderError("invalid", f"reservation {reservation} is for flavor {found.flavor}")
        if found.state != "ready":
            raise ProviderError("invalid", f"reservation {reservation} is not ready")
        if self.in_use(account, reservation) >= found.total:
            raise ProviderError("exhausted", f"reservation {reservation} has no free slot")

    def _instance(self, account: str, name: str) -> Instance:
        found = self.instances.get((account, name))
        if found is None:
            raise ProviderError("not-found", f"no instance {name}")
        return found

    def get_instance(self, account: str, name: str) -> Instance:
        with self._lock:
            return self._instance(account, name)

    def list_instances(self, account: str) -> list[Instance]:
        with self._lock:
            return sorted((i for i in self.instances.values() if i.account == account and i.state != "deleted"),
                          key=lambda i: i.name)

    def stop_instance(self, account: str, name: str) -> Instance:
        with self._lock:
            instance = self._instance(account, name)
            if instance.state == "deleted":
                raise ProviderError("not-found", f"instance {name} is deleted")
            instance.state = "stopped"
            return instance

    def start_instance(self, account: str, name: str) -> Instance:
        with self._lock:
            instance = self._instance(account, name)
            if instance.state == "deleted":
                raise ProviderError("not-found", f"instance {name} is deleted")
            if instance.state == "stopped":
                if instance.reservation and (account, instance.reservation) in self.reservations:
                    self._take_slot(account, instance.reservation, instance.flavor)
                instance.state = "running"
            return instance

    def delete_instance(self, account: str, name: str) -> Instance:
        with self._lock:
            instance = self._instance(account, name)
            instance.state = "deleted"
            return instance
