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
``LeaseExpired`` when a lease used or refreshed no longer exists; ``StoreCompacted`` when
``wait`` asks for history the store no longer keeps (re-read, then wait from
``revision()``); ``StoreError`` for anything else the user must fix (bad URL, bad
credentials, bad arguments).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pollux_launch.errors import UserError


class StoreError(UserError, RuntimeError):
    """A store problem the user must fix (bad URL, bad options, bad credentials)."""


class StoreUnavailable(StoreError):
    """The store could not be reached in time; the operation may be retried."""


class LeaseExpired(StoreError):
    """The lease expired or was revoked (refresh it no more: grant a new one)."""


class StoreCompacted(StoreError):
    """``wait`` asked for changes older than the history the store keeps."""


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

    def keep_alive(self, lease: int, interval: float) -> KeepAlive:
        """Refresh ``lease`` every ``interval`` seconds from a daemon thread until
        ``stop()``; see ``KeepAlive``. Pick ``interval`` at most a third of the TTL."""
        return KeepAlive(self, lease, interval)

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

    def scoped_credentials(self, name: str, readwrite: Sequence[str],
                           read: Sequence[str]) -> tuple[str, str] | None:
        """A user ``name`` of this store that may read and write the keys under the
        ``readwrite`` prefixes and read those under ``read``, nothing else, and its new
        password - for processes that must not hold this store's own credentials. None
        where the store has no authentication (nothing to scope: the embedded store, an
        etcd without auth). Asking again for the same name gives a new password."""
        return None

    def drop_scoped_credentials(self, name: str) -> None:  # noqa: B027 - see above
        """Remove the user ``scoped_credentials`` made (nothing where it made none)."""

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release connections and background threads."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KeepAlive:
    """A daemon thread that refreshes one lease (``Store.keep_alive``).

    A store that is briefly unreachable is retried at every tick; the thread ends when
    the lease is gone (``expired`` is set, ``error`` holds the ``LeaseExpired``) or on
    ``stop()``. Callers poll ``expired`` (or wait on it) to learn that their keys are gone.
    """

    def __init__(self, store: Store, lease: int, interval: float) -> None:
        if not interval > 0:
            raise StoreError(f"keep-alive interval must be > 0 seconds, got {interval!r}")
        self.store, self.lease, self.interval = store, lease, float(interval)
        self.expired = threading.Event()
        self.error: StoreError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"pollux-lease-{lease:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.lease_refresh(self.lease)
            except LeaseExpired as exc:
                self.error = exc
                self.expired.set()
                return
            except StoreError as exc:  # unreachable for now: retry at the next tick
                self.error = exc

    def stop(self, revoke: bool = False) -> None:
        """End the refreshing; with ``revoke`` also end the lease (deleting its keys)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if revoke:
            self.store.lease_revoke(self.lease)

    def __enter__(self) -> KeepAlive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_key(key: object) -> str:
    """``key`` if it is a usable key, else a one-line StoreError."""
    if not isinstance(key, str):
        raise StoreError(f"store keys are str, got {type(key).__name__} {key!r}")
    return key


def check_value(value: object) -> str:
    """``value`` if it is JSON text, else a one-line StoreError (never pickle)."""
    if not isinstance(value, str):
        raise StoreError(
            f"store values are JSON text (str), got {type(value).__name__}; "
            "encode it first (pollux_launch.messages.encode or json.dumps)")
    return value


def check_ops(ops: Sequence[Put | Delete]) -> None:
    """etcd's rule, enforced by every backend: within one branch of a transaction no key
    may be written twice (two puts, or a put inside a deleted range)."""
    puts: set[str] = set()
    for op in ops:
        if isinstance(op, Put):
            check_key(op.key)
            check_value(op.value)
            if op.key in puts:
                raise StoreError(f"transaction writes key {op.key!r} twice; write it once")
            puts.add(op.key)
        elif isinstance(op, Delete):
            check_key(op.key)
        else:
            raise StoreError(f"transaction operations are Put or Delete, got {op!r}")
    for op in ops:
        if isinstance(op, Delete) and any(
                k == op.key or (op.prefix and k.startswith(op.key)) for k in puts):
            raise StoreError(f"transaction both deletes and puts {op.key!r}; do one")


def check_compare(cmp: Compare) -> None:
    """A one-line StoreError for a malformed comparison."""
    if not isinstance(cmp, Compare):
        raise StoreError(f"transaction conditions are Compare, got {cmp!r}")
    check_key(cmp.key)
    if cmp.op not in ("==", "!=", "<", ">"):
        raise StoreError(f"compare op must be one of == != < >, got {cmp.op!r}")
    if cmp.target == "value":
        if not isinstance(cmp.operand, str):
            raise StoreError(f"compare on value needs a str operand, got {cmp.operand!r}")
    elif cmp.target in ("mod_revision", "create_revision"):
        if not isinstance(cmp.operand, int) or isinstance(cmp.operand, bool):
            raise StoreError(f"compare on {cmp.target} needs an int, got {cmp.operand!r}")
    else:
        raise StoreError(
            f"compare target must be value, mod_revision or create_revision, got {cmp.target!r}")


def prefix_end(prefix: str) -> str:
    """The smallest string above every string starting with ``prefix`` (non-empty).

    UTF-8 preserves code-point order, so this bound is right for both the byte-ordered
    etcd keyspace and SQLite's BINARY collation."""
    while prefix and prefix[-1] == chr(0x10FFFF):  # no code point above: shorten
        prefix = prefix[:-1]
    if not prefix:
        raise StoreError("a key prefix made only of U+10FFFF has no upper bound")
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
