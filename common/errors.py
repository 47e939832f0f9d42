"""What loraplex refuses, as domain errors: each class is a kind of failure a client can
act on, and its message says what was wrong and what is accepted. The registry raises them,
and the engine raises `AdapterRejected` for an adapter it will not load. Nothing here knows HTTP:
`registry/api_errors.py` gives each kind its status code and the tenant API's body, and the
ingress gives the same codes OpenAI's body.

    RegistryError
    ├── AdapterRejected      an adapter or its upload, refused before anything was written
    │   ├── Invalid          input that cannot be read: bad JSON, a corrupt header or
    │   │                    archive, a forbidden path, a malformed form
    │   ├── TooLarge         over a size limit
    │   └── Unacceptable     a well-formed adapter the server does not accept (rank,
    │                        targets, shapes, dtype, options), or a request body it refuses
    ├── Unauthenticated      no key, or a key nobody holds
    ├── Forbidden            a key of the wrong kind for the operation
    ├── NotFound             no such tenant or adapter (another tenant's reads the same)
    ├── Conflict             a name taken, a quota reached, a concurrent change
    │   ├── AlreadyExists    create of a key that exists
    │   └── RevisionConflict update whose expected revision is not the key's
    │       └── OwnerChanged the tenant's record changed since the write was authorised
    ├── TimedOut             a request body that stopped arriving (idle or total timeout)
    ├── Busy                 refused for now, retry later (registry/admission.py)
    │   ├── TooManyUploads   the tenant's registration slots are all in flight
    │   └── StagingFull      the uploads in flight hold the whole staging budget
    └── RegistryUnavailable  etcd could not be reached or did not answer in time
"""

from __future__ import annotations


class RegistryError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class AdapterRejected(RegistryError, ValueError):
    """An adapter (or its upload) refused before anything was written."""


class Invalid(AdapterRejected):
    """Input that cannot be read, or a form or path that is not allowed. `field`: the
    request body's top-level field it concerns, when known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TooLarge(AdapterRejected):
    """Input over a size limit."""


class Unacceptable(AdapterRejected):
    """Well-formed, but not accepted: unsupported options, rank, dtype, shapes."""


class Unauthenticated(RegistryError):
    """No API key, an unknown one, or the key of a tenant deleted meanwhile."""


class TimedOut(RegistryError):
    """A request body that paused too long between bytes, or took too long in all."""


class Forbidden(RegistryError):
    """A key of the wrong kind: a tenant key on an admin operation, or the reverse."""


class NotFound(RegistryError):
    """The tenant or adapter does not exist."""


class Conflict(RegistryError):
    """The name is taken, the quota is reached, or the record changed meanwhile."""


class AlreadyExists(Conflict):
    """Create of a key that exists."""


class RevisionConflict(Conflict):
    """Update whose expected revision is not the key's current revision."""


class OwnerChanged(RevisionConflict):
    """A write authorised against the tenant's record at one revision met it at another
    (a key issued or revoked, limits changed, or the tenant deleted and created again):
    the caller checks its grant again and retries, or refuses."""


class RegistryUnavailable(RegistryError):
    """etcd could not be reached or did not answer in time; a write was not made (or its
    outcome is unknown: retrying is safe, creates are create-if-absent)."""

    retry_after_s = 5


class Busy(RegistryError):
    """Refused for now: retrying after `retry_after_s` may succeed."""

    retry_after_s = 5


class TooManyUploads(Busy):
    """The tenant has `max_uploads_per_tenant` registrations in flight."""


class StagingFull(Busy):
    """The registrations in flight hold the whole staging budget (`staging_max_bytes`)."""
