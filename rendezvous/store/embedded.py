"""The embedded backend: one SQLite file in WAL mode shared by every process on a machine.

No server: each process opens the file and SQLite's locking makes the writes atomic
(``BEGIN IMMEDIATE`` serialises writers, readers never block). The etcd semantics are
kept table by table:

* ``meta``    the store-wide revision and the compaction point of the history;
* ``kv``      key, value, create/mod revision, lease;
* ``leases``  id, TTL and wall-clock expiry (``time.time()``, shared by all processes);
* ``events``  the history ``wait`` reads: one row per changed key, pruned to the last
  ``history`` revisions.

Leases expire lazily but consistently: every read, write and ``wait`` of any process
first deletes the keys of leases whose expiry has passed (one revision, like etcd's
lease revoke), so no process ever sees a key whose lease is over. ``wait`` polls
``PRAGMA data_version`` (a read of WAL shared memory, no disk I/O) every
``poll_interval`` seconds and queries the history only when another connection wrote.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from pollux_launch.env import DEFAULT_PREFIX

from .base import (
    Compare,
    Delete,
    Event,
    KeyValue,
    LeaseExpired,
    Put,
    Store,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
    check_compare,
    check_key,
    check_ops,
    check_value,
    prefix_end,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('schema', 1), ('revision', 1), ('compacted', 0);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value TEXT NOT NULL,
    create_rev INTEGER NOT NULL, mod_rev INTEGER NOT NULL, lease INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_lease ON kv(lease) WHERE lease != 0;
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY, ttl REAL NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_expires ON leases(expires);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY, rev INTEGER NOT NULL,
    kind TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_rev ON events(rev);
"""

_OPS = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b, ">": lambda a, b: a > b,
}


def default_path() -> Path:
    """Where ``embedded://`` keeps its file: the per-user runtime dir, else ~/.cache."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK):
        return Path(runtime) / "pollux-launch" / "store.db"
    return Path.home() / ".cache" / "pollux-launch" / "store.db"


def path_from_url(url: str) -> Path:
    """``embedded:///abs/path.db`` -> that path; ``embedded://`` -> ``default_path()``."""
    parts = urlsplit(url)
    if parts.scheme != "embedded":
        raise StoreError(f"not an embedded store URL: {url!r}")
    if parts.netloc or parts.query or parts.fragment:
        raise StoreError(
            f"bad embedded store URL {url!r}: use embedded:///absolute/path/store.db "
            "(three slashes) or embedded:// for the default per-user file")
    if not parts.path:
        return default_path()
    if not parts.path.startswith("/"):
        raise StoreError(f"bad embedded store URL {url!r}: the path must be absolute "
                         "(embedded:///absolute/path/store.db)")
    return Path(parts.path)


class _Tx:
    """The writes of one SQLite transaction; all its changes share revision ``rev``."""

    def __init__(self, conn: sqlite3.Connection, rev: int) -> None:
        self.conn, self.rev, self.changed = conn, rev + 1, False

    def put(self, key: str, value: str, lease: int) -> None:
        if lease and self.conn.execute(
                "SELECT 1 FROM leases WHERE id = ?", (lease,)).fetchone() is None:
            raise LeaseExpired(f"lease {lease:x} has expired or was revoked; grant a new one")
        self.conn.execute(
            "INSERT INTO kv VALUES (?1, ?2, ?3, ?3, ?4) ON CONFLICT(key) DO UPDATE SET "
            "value = excluded.value, mod_rev = excluded.mod_rev, lease = excluded.lease",
            (key, value, self.rev, lease))
        self.conn.execute("INSERT INTO events (rev, kind, key, value) VALUES (?, 'put', ?, ?)",
                          (self.rev, key, value))
        self.changed = True

    def delete_where(self, where: str, args: tuple) -> int:
        keys = [r[0] for r in self.conn.execute(f"SELECT key FROM kv WHERE {where}", args)]
        if keys:
            self.conn.execute(f"DELETE FROM kv WHERE {where}", args)
            self.conn.executemany(
                "INSERT INTO events (rev, kind, key, value) VALUES (?, 'delete', ?, '')",
                [(self.rev, k) for k in keys])
            self.changed = True
        return len(keys)

    def commit_revision(self) -> None:
        self.conn.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (self.rev,))


def _busy(exc: sqlite3.Error) -> bool:
    """Whether SQLite refused because another connection holds a lock."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    # Python 3.10's sqlite3 exceptions carry no error code: only the text tells
    msg = str(exc)
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg)


class EmbeddedStore(Store):
    """A ``Store`` in one SQLite file; safe for many threads and processes on one host.

    ``prefix`` separates clusters sharing a file; ``timeout`` bounds how long a write
    waits for another process's lock; ``poll_interval`` is ``wait``'s sleep between
    checks; ``history`` is how many revisions of events ``wait`` can look back over.
    """

    def __init__(self, path: str | os.PathLike, prefix: str = DEFAULT_PREFIX, *,
                 timeout: float = 10.0, poll_interval: float = 0.005,
                 history: int = 10_000) -> None:
        if not timeout > 0 or not poll_interval > 0 or int(history) < 1:
            raise StoreError("embedded store options: timeout and poll_interval must be "
                             f"> 0 and history >= 1 (got {timeout}, {poll_interval}, {history})")
        self.path = Path(path)
        self.prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
        self.timeout, self.poll_interval, self.history = timeout, poll_interval, int(history)
        self._local = threading.local()
        # every thread's connection, with its thread: close() closes only those no other
        # live thread may be using (closing one under a thread inside sqlite crashes the
        # process); the others are closed by their threads at their next use
        self._conns: list[tuple[sqlite3.Connection, threading.Thread]] = []
        self._conns_lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        if self.path == default_path():  # ours to make; a path the user names is not
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise StoreError(f"embedded store: cannot create {self.path.parent}: "
                                 f"{exc.strerror}; pick a writable path") from None
        elif not self.path.parent.is_dir():
            raise StoreError(f"embedded store: folder {self.path.parent} does not exist; "
                             "create it, or give a path in an existing folder")
        self._conn()  # fail now, with a clear message, if the file is unusable

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, **options: float) -> EmbeddedStore:
        return cls(path_from_url(url), prefix, **options)

    def __repr__(self) -> str:
        return f"EmbeddedStore('embedded://{self.path}', prefix={self.prefix!r})"

    # -- connections ---------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (SQLite connections must not cross threads or forks).
        Raises StoreError once the store is closed."""
        if self._closed:
            self._close_mine()
            raise StoreError(f"{self!r} is closed")
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        if self._pid != os.getpid():  # forked child: the parent's connections are not ours
            self._pid, self._conns = os.getpid(), []
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn = self._open()
                break
            except sqlite3.Error as exc:
                # Switching a new file to WAL takes an exclusive lock and SQLite answers
                # SQLITE_BUSY at once, without its busy handler, when another process is
                # doing the same: retry that until the timeout like any other wait.
                if not _busy(exc) or time.monotonic() >= deadline:
                    raise self._error(exc) from None
                time.sleep(random.uniform(0.005, 0.05))
        self._local.conn, self._local.pid = conn, os.getpid()
        with self._conns_lock:
            self._conns.append((conn, threading.current_thread()))
        return conn

    def _close_mine(self) -> None:
        """Close this thread's connection (the store was closed while it was in use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            return
        self._local.conn = None
        with self._conns_lock:
            self._conns = [(c, t) for c, t in self._conns if c is not conn]
        conn.close()

    def _open(self) -> sqlite3.Connection:
        """A new connection in WAL mode with the schema in place (closed on failure)."""
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None,
                               check_same_thread=False)
        try:
            # bytes that are not UTF-8 (written by other means) reach the message layer,
            # which refuses them, instead of failing the read
            conn.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
            conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
            if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise StoreError(f"embedded store: {self.path} cannot use WAL mode "
                                 "(network file systems cannot); use a local path")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        except BaseException:
            conn.close()
            raise
        return conn

    def _error(self, exc: sqlite3.Error) -> StoreError:
        msg = str(exc)
        if _busy(exc):
            return StoreUnavailable(
                f"embedded store {self.path}: another process held the lock for more than "
                f"{self.timeout:g} s; retry, or raise the timeout option")
        return StoreError(f"embedded store {self.path}: {msg}; check the path and its "
                          "permissions, or delete a corrupt file")

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _write(self, fn: Callable[[_Tx], T]) -> T:
        """Run ``fn`` in one write transaction after expiring due leases; commit the new
        revision if ``fn`` changed anything."""
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                rev = conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0]
                tx = _Tx(conn, self._expire(conn, rev))
                result = fn(tx)
                if tx.changed:
                    tx.commit_revision()
                    self._prune(conn, tx.rev)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        return result

    def _expire(self, conn: sqlite3.Connection, rev: int) -> int:
        """Inside a write transaction: drop leases past expiry and their keys (one
        revision for all of them); returns the revision after."""
        now = time.time()
        expired = [r[0] for r in conn.execute("SELECT id FROM leases WHERE expires <= ?", (now,))]
        if not expired:
            return rev
        tx = _Tx(conn, rev)
        marks = ",".join("?" * len(expired))
        tx.delete_where(f"lease IN ({marks})", tuple(expired))
        conn.execute(f"DELETE FROM leases WHERE id IN ({marks})", tuple(expired))
        if tx.changed:
            tx.commit_revision()
            return tx.rev
        return rev

    def _prune(self, conn: sqlite3.Connection, rev: int) -> None:
        if rev % 256 == 0 and rev > self.history:
            conn.execute("DELETE FROM events WHERE rev <= ?", (rev - self.history,))
            conn.execute("UPDATE meta SET value = max(value, ?) WHERE name = 'compacted'",
                         (rev - self.history,))

    def _expire_due(self, conn: sqlite3.Connection) -> float | None:
        """Expire leases if one is due; returns the next expiry time (or None)."""
        row = conn.execute("SELECT min(expires) FROM leases").fetchone()
        if row[0] is not None and row[0] <= time.time():
            self._write(lambda tx: None)
            row = conn.execute("SELECT min(expires) FROM leases").fetchone()
        return row[0]

    def _read(self, sql: str, args: tuple) -> list[tuple]:
        conn = self._conn()
        try:
            self._expire_due(conn)
            return conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _kv(self, row: tuple) -> KeyValue:
        return KeyValue(row[0][len(self.prefix):], row[1], row[2], row[3], row[4])

    # -- the Store interface --------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        rows = self._read("SELECT * FROM kv WHERE key = ?", (self._key(key),))
        return self._kv(rows[0]) if rows else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        lo = self._key(prefix)
        rows = self._read("SELECT * FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                          (lo, prefix_end(lo)))
        return [self._kv(r) for r in rows]

    def put(self, key: str, value: str, lease: int = 0) -> int:
        full, value = self._key(key), check_value(value)

        def op(tx: _Tx) -> int:
            tx.put(full, value, lease)
            return tx.rev
        return self._write(op)

    def _delete(self, tx: _Tx, key: str, prefix: bool) -> int:
        full = self._key(key)
        if prefix:
            return tx.delete_where("key >= ? AND key < ?", (full, prefix_end(full)))
        return tx.delete_where("key = ?", (full,))

    def delete(self, key: str, prefix: bool = False) -> int:
        check_key(key)
        return self._write(lambda tx: self._delete(tx, key, prefix))

    def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
            failure: Sequence[Put | Delete] = ()) -> bool:
        for c in compare:
            check_compare(c)
        check_ops(success)
        check_ops(failure)

        def op(tx: _Tx) -> bool:
            ok = all(self._holds(tx.conn, c) for c in compare)
            for o in success if ok else failure:
                if isinstance(o, Put):
                    tx.put(self._key(o.key), o.value, o.lease)
                else:
                    self._delete(tx, o.key, o.prefix)
            return ok
        return self._write(op)

    def _holds(self, conn: sqlite3.Connection, c: Compare) -> bool:
        row = conn.execute("SELECT value, create_rev, mod_rev FROM kv WHERE key = ?",
                           (self._key(c.key),)).fetchone()
        if c.target == "value":
            # etcd: a value comparison on a missing key always fails
            return row is not None and _OPS[c.op](row[0], c.operand)
        have = 0 if row is None else row[1 if c.target == "create_revision" else 2]
        return _OPS[c.op](have, c.operand)

    def lease_grant(self, ttl: float) -> int:
        if not isinstance(ttl, (int, float)) or not ttl > 0:
            raise StoreError(f"lease TTL must be a positive number of seconds, got {ttl!r}")
        lease = random.getrandbits(62) + 1

        def op(tx: _Tx) -> int:
            tx.conn.execute("INSERT INTO leases VALUES (?, ?, ?)",
                            (lease, float(ttl), time.time() + ttl))
            return lease
        return self._write(op)

    def lease_refresh(self, lease: int) -> None:
        def op(tx: _Tx) -> None:
            cur = tx.conn.execute("UPDATE leases SET expires = ? + ttl WHERE id = ?",
                                  (time.time(), lease))
            if cur.rowcount != 1:
                raise LeaseExpired(f"lease {lease:x} has expired or was revoked; "
                                   "grant a new one and re-put its keys")
        self._write(op)

    def lease_revoke(self, lease: int) -> None:
        def op(tx: _Tx) -> None:
            tx.delete_where("lease = ?", (lease,))
            tx.conn.execute("DELETE FROM leases WHERE id = ?", (lease,))
        self._write(op)

    def revision(self) -> int:
        return self._read("SELECT value FROM meta WHERE name = 'revision'", ())[0][0]

    def wait(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        lo = self._key(prefix)
        hi = prefix_end(lo)
        conn = self._conn()
        deadline = time.monotonic() + max(0.0, timeout)
        seen = None
        next_expiry: float | None = None
        try:
            while True:
                version = conn.execute("PRAGMA data_version").fetchone()[0]
                due = next_expiry is not None and next_expiry <= time.time()
                if version != seen or due:
                    seen = version
                    next_expiry = self._expire_due(conn)
                    events = self._events(conn, lo, hi, after_revision)
                    if events:
                        return events
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                time.sleep(min(self.poll_interval, remaining))
                if self._closed:  # (closed by another thread: this one's to close)
                    self._close_mine()
                    raise StoreError(f"{self!r} is closed")
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _events(self, conn: sqlite3.Connection, lo: str, hi: str, after: int) -> list[Event]:
        conn.execute("BEGIN")  # one snapshot for the history and its compaction point
        try:
            rows = conn.execute(
                "SELECT kind, key, value, rev FROM events WHERE rev > ? AND key >= ? "
                "AND key < ? ORDER BY seq", (after, lo, hi)).fetchall()
            compacted = conn.execute(
                "SELECT value FROM meta WHERE name = 'compacted'").fetchone()[0]
        finally:
            conn.execute("COMMIT")
        if after < compacted:
            raise StoreCompacted(
                f"embedded store keeps events after revision {compacted} only, asked for "
                f"those after {after}: re-read the keys, then wait from revision()")
        n = len(self.prefix)
        return [Event(kind, key[n:], value, rev) for kind, key, value, rev in rows]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        me = threading.current_thread()
        with self._conns_lock:
            mine = self._conns if self._pid == os.getpid() else []
            conns = [c for c, t in mine if t is me or not t.is_alive()]
            self._conns = [(c, t) for c, t in mine if t is not me and t.is_alive()]
        for conn in conns:
            conn.close()
