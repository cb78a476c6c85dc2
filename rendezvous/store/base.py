"""The ``Store`` interface: the one contract behind every backend (etcd, embedded).

Semantics follow etcd v3, so that the etcd backend is a thin mapping and the embedded
backend can be tested against the same contract suite:

* Keys are ``str`` relative to the store's cluster prefix (a backend prepends it);
  values are ``str`` holding JSON text (see ``pollux_launch.messages``). A backend never
  pickles or evaluates anything.
* Every successful write increments one store-wide *revision*; each key remembers the
  revision that created it and the one that last modified it.
* ``txn`` is an atomic compare-and-swap over several keys.
* A *lease* has a TTL in seconds; keys put with a lease are deleted when the lease
  expires or is revoked. ``lease_refresh`` is the keep-alive.
* ``wait`` is the efficient "tell me when anything under this prefix changes after
  revision R" primitive (etcd: a watch; embedded: a cheap poll of the revision).

Errors: ``StoreUnavailable`` when the backend cannot be reached (callers may retry);
``StoreError`` for anything else the user must fix (bad URL, bad credentials).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


class StoreError(RuntimeError):
    """A store problem the user must fix (bad URL, bad options, bad credentials)."""


class StoreUnavailable(StoreError):
    """The store could not be reached in time; the operation may be retried."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Event:
    """A change seen by ``wait``: ``kind`` is "put" or "delete" (value "" on delete)."""

    kind: Literal["put", "delete"]
    key: str
    value: str
    revision: int


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction.

    ``target`` "value" compares the value text; "mod_revision" / "create_revision"
    compare revisions (a missing key has revision 0, so ``Compare(k, "create_revision",
    "==", 0)`` means "k does not exist").
    """

    key: str
    target: Literal["value", "mod_revision", "create_revision"]
    op: Literal["==", "!=", "<", ">"]
    operand: str | int


@dataclass(frozen=True)
class Put:
    key: str
    value: str
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


class Store(abc.ABC):
    """A small consistent key-value store with revisions, transactions and leases."""

    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None:
        """The key's current value, or None."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, sorted by key."""

    @abc.abstractmethod
    def put(self, key: str, value: str, lease: int = 0) -> int:
        """Set ``key``; returns the new store revision."""

    @abc.abstractmethod
    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it with ``prefix``); returns how many."""

    @abc.abstractmethod
    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> bool:
        """Atomically: if every comparison holds apply ``success`` and return True,
        else apply ``failure`` and return False."""

    def create(self, key: str, value: str, lease: int = 0) -> bool:
        """Put ``key`` only if it does not exist; True if this call created it."""
        return self.txn([Compare(key, "create_revision", "==", 0)], [Put(key, value, lease)])

    @abc.abstractmethod
    def lease_grant(self, ttl: float) -> int:
        """A new lease id that expires ``ttl`` seconds after its last refresh."""

    @abc.abstractmethod
    def lease_refresh(self, lease: int) -> None:
        """Keep the lease alive; raises StoreError if it already expired."""

    @abc.abstractmethod
    def lease_revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys."""

    @abc.abstractmethod
    def revision(self) -> int:
        """The store's current revision."""

    @abc.abstractmethod
    def wait(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        """Block until some key under ``prefix`` changes at a revision greater than
        ``after_revision`` (returning those events, oldest first) or ``timeout`` seconds
        pass (returning [])."""

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release connections and background threads."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
