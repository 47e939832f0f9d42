"""Admission of registrations: how many one tenant may have in flight, and how many bytes all
of them together may hold in the staging folder.

Every registration holds a slot of its tenant for its whole life (`max_uploads_per_tenant`),
and reserves staging bytes before it writes them: a multipart body as it arrives, and
`max_adapter_bytes` before an archive is extracted or a path is copied (what that step can
write at most). The sum of reservations never passes `staging_max_bytes`; a registration that
would pass it is refused at once (`StagingFull`, retry later), so a burst of uploads — each within its
own limits — cannot fill the disk. State lives on the event loop: no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.errors import StagingFull, TooManyUploads


def check_staging_budget(
    staging_max_bytes: int, max_upload_bytes: int, max_adapter_bytes: int
) -> None:
    """One largest upload and its extraction must fit, or no archive could ever register."""
    if staging_max_bytes < max_upload_bytes + max_adapter_bytes:
        raise ValueError(
            f"staging_max_bytes ({staging_max_bytes}) must hold one largest upload and its "
            f"extraction: at least max_upload_bytes + max_adapter_bytes "
            f"({max_upload_bytes + max_adapter_bytes})"
        )


class Reservation:
    """Staging bytes held by one registration; returned when it ends."""

    def __init__(self, admission: UploadAdmission) -> None:
        self._admission = admission
        self.held = 0

    def take(self, n: int) -> None:
        admission = self._admission
        if admission.staged + n > admission.staging_max_bytes:
            raise StagingFull(
                "the registry's staging space is in use by other uploads "
                f"(staging_max_bytes = {admission.staging_max_bytes}); retry later",
            )
        admission.staged += n
        self.held += n

    def release(self) -> None:
        self._admission.staged -= self.held
        self.held = 0


class UploadAdmission:
    def __init__(self, max_uploads_per_tenant: int, staging_max_bytes: int) -> None:
        assert max_uploads_per_tenant >= 1 and staging_max_bytes >= 1
        self.max_uploads_per_tenant = max_uploads_per_tenant
        self.staging_max_bytes = staging_max_bytes
        self.staged = 0
        self.in_flight: dict[str, int] = {}

    @contextmanager
    def admit(self, tenant: str) -> Iterator[Reservation]:
        """A slot of `tenant` and an empty reservation, for one registration."""
        if self.in_flight.get(tenant, 0) >= self.max_uploads_per_tenant:
            raise TooManyUploads(
                f"{self.max_uploads_per_tenant} registrations of tenant {tenant!r} are in "
                "flight (max_uploads_per_tenant); retry when one has finished",
            )
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        reservation = Reservation(self)
        try:
            yield reservation
        finally:
            reservation.release()
            self.in_flight[tenant] -= 1
            if not self.in_flight[tenant]:
                del self.in_flight[tenant]
