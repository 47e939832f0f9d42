"""Admission of registrations: how many one tenant may have in flight, and how many bytes all
of them together, and each tenant's, may hold in the staging folder.

Every registration holds a slot of its tenant for its whole life (`max_uploads_per_tenant`),
and reserves staging bytes before it writes them: a multipart body as it arrives, and
`max_adapter_bytes` before an archive is extracted or a path is copied (what that step can
write at most). The sum of reservations never passes `staging_max_bytes`, and one tenant's
never passes its share of it (`staging_tenant_share`); a registration that would pass either
is refused at once (`StagingFull`, retry later), so a burst of uploads — each within its own
limits — cannot fill the disk, nor one tenant's stalled uploads keep the others out.

A registration lives only while the key that began it holds: when its tenant is deleted or
the key revoked (`revoke`, and every change the watcher sees), the registration's task is
cancelled where it is (receiving, staging, validating) and answers 401, freeing its slot,
staging bytes and folder. From its commit on it is no longer cancelled: the commit's etcd
transaction checks the key itself (registry/service.py). State lives on the event loop: no
lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from loraplex.errors import StagingFull, TooManyUploads, Unauthenticated

if TYPE_CHECKING:
    from loraplex.registry.auth import Grant
    from loraplex.registry.models import Tenant
    from loraplex.registry.watch import RegistryWatcher


def check_staging_budget(
    staging_max_bytes: int, max_upload_bytes: int, max_adapter_bytes: int, tenant_share: float
) -> None:
    """One largest upload and its extraction must fit one tenant's share, or no archive
    could ever register."""
    one = max_upload_bytes + max_adapter_bytes
    if staging_max_bytes * tenant_share < one:
        raise ValueError(
            f"staging_max_bytes x staging_tenant_share ({staging_max_bytes} x {tenant_share}) "
            f"must hold one largest upload and its extraction: at least max_upload_bytes + "
            f"max_adapter_bytes ({one})"
        )


class Reservation:
    """One registration: its staging bytes (returned when it ends) and the grant it runs
    under."""

    def __init__(self, admission: UploadAdmission, grant: Grant, task: asyncio.Task) -> None:
        self._admission = admission
        self.grant = grant
        self.tenant = grant.tenant.name
        self.task = task
        self.held = 0
        self.committing = False
        self.revoked = False

    def take(self, n: int) -> None:
        admission = self._admission
        if admission.staged + n > admission.staging_max_bytes:
            raise StagingFull(
                "the registry's staging space is in use by other uploads "
                f"(staging_max_bytes = {admission.staging_max_bytes}); retry later",
            )
        tenant_staged = admission.staged_by_tenant.get(self.tenant, 0)
        if tenant_staged + n > admission.tenant_max_bytes:
            raise StagingFull(
                f"tenant {self.tenant!r}'s uploads in flight hold its share of the staging "
                f"space ({admission.tenant_max_bytes} bytes, staging_tenant_share); retry "
                "when one has finished",
            )
        admission.staged += n
        admission.staged_by_tenant[self.tenant] = tenant_staged + n
        self.held += n

    def commit(self) -> None:
        """From here on the registration is not cancelled: its commit checks the key."""
        self.committing = True

    def release(self) -> None:
        admission = self._admission
        admission.staged -= self.held
        left = admission.staged_by_tenant.pop(self.tenant, 0) - self.held
        if left:
            admission.staged_by_tenant[self.tenant] = left
        self.held = 0


class UploadAdmission:
    def __init__(
        self,
        max_uploads_per_tenant: int,
        staging_max_bytes: int,
        tenant_share: float = 1.0,
        watcher: RegistryWatcher | None = None,
    ) -> None:
        """`watcher`: registrations are cancelled when it shows their key revoked (None:
        only through `revoke`)."""
        assert max_uploads_per_tenant >= 1 and staging_max_bytes >= 1 and 0 < tenant_share <= 1
        self.max_uploads_per_tenant = max_uploads_per_tenant
        self.staging_max_bytes = staging_max_bytes
        self.tenant_max_bytes = int(staging_max_bytes * tenant_share)
        self.watcher = watcher
        self.staged = 0
        self.staged_by_tenant: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}
        self._live: dict[str, set[Reservation]] = {}

    @contextmanager
    def admit(self, grant: Grant) -> Iterator[Reservation]:
        """A slot of the grant's tenant and an empty reservation, for one registration run
        by the current task; Unauthenticated if the grant is revoked before its commit."""
        tenant = grant.tenant.name
        if self.in_flight.get(tenant, 0) >= self.max_uploads_per_tenant:
            raise TooManyUploads(
                f"{self.max_uploads_per_tenant} registrations of tenant {tenant!r} are in "
                "flight (max_uploads_per_tenant); retry when one has finished",
            )
        task = asyncio.current_task()
        assert task is not None, "a registration runs in a task"
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        reservation = Reservation(self, grant, task)
        self._live.setdefault(tenant, set()).add(reservation)
        watching = None
        if self.watcher is not None:
            watching = asyncio.create_task(self._follow(reservation, self.watcher))
        try:
            yield reservation
        except asyncio.CancelledError:
            if reservation.revoked and task.uncancel() == 0:
                raise Unauthenticated(
                    "the API key this registration began with was revoked, or its tenant "
                    "deleted, while it was in flight; nothing was registered"
                ) from None
            raise
        finally:
            if watching is not None:
                watching.cancel()
            self._live[tenant].discard(reservation)
            if not self._live[tenant]:
                del self._live[tenant]
            reservation.release()
            self.in_flight[tenant] -= 1
            if not self.in_flight[tenant]:
                del self.in_flight[tenant]

    def revoke(self, tenant: str, current: Tenant | None) -> int:
        """Cancel the registrations of `tenant` that `current` (its record now; None: it is
        deleted) no longer honours and that are not committing; how many."""
        cancelled = 0
        for reservation in list(self._live.get(tenant, ())):
            if reservation.committing or reservation.revoked:
                continue
            if not reservation.grant.holds(current):
                reservation.revoked = True
                reservation.task.cancel()
                cancelled += 1
        return cancelled

    async def _follow(self, reservation: Reservation, watcher: RegistryWatcher) -> None:
        """Revoke `reservation` once the watcher shows its grant no longer holds."""
        events = watcher.subscribe()
        try:
            while not self.revoke(reservation.tenant, watcher.tenant(reservation.tenant)):
                await events.get()
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:  # a burst of events: check once
                        events.get_nowait()
        finally:
            watcher.unsubscribe(events)
