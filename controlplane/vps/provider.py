"""The provider interface: all the control plane asks of a cloud provider. `providersim` serves it
over gRPC (adapter: vps/sim_adapter.py); a real provider's adapter would implement the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ProviderReservation:
    name: str
    flavor: str
    region: str
    total: int
    state: str  # ready or creating


@dataclass(frozen=True)
class ProviderInstance:
    name: str
    flavor: str
    reservation: str  # empty: on demand
    state: str  # running, stopped, deleted


class ProviderFailure(Exception):
    """The provider did not answer, or refused: `kind` is unavailable, not-found, exhausted or
    invalid."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Provider(Protocol):
    async def list_reservations(self, account: str) -> list[ProviderReservation]: ...

    async def create_instance(self, account: str, name: str, flavor: str, region: str,
                              reservation: str) -> ProviderInstance: ...

    async def list_instances(self, account: str) -> list[ProviderInstance]: ...

    async def stop_instance(self, account: str, name: str) -> ProviderInstance: ...

    async def start_instance(self, account: str, name: str) -> ProviderInstance: ...

    async def delete_instance(self, account: str, name: str) -> ProviderInstance: ...
