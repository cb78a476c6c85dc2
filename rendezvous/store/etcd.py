"""The etcd backend: the etcd v3 gRPC API, for clusters of many machines.

The gRPC stubs and messages come from ``etcd-sdk-python`` (``pyetcd.etcdrpc``: etcd's
protobufs compiled for modern protobuf); the client logic is ours, because the packaged
client marks an endpoint failed for 300 s after one error, which defeats reconnecting
after an etcd restart. Here each endpoint is one gRPC channel that reconnects by
itself (backoff capped at 1 s); calls wait for a connection up to ``timeout``
(``wait_for_ready``) and then raise ``StoreUnavailable``; reads, puts and lease calls
are retried within that timeout when a connection breaks mid-call, transactions are not
(they may have been applied). ``wait`` is an etcd watch from ``after_revision + 1``.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

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

try:
    import grpc
    from pyetcd import etcdrpc
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the etcd store needs etcd-sdk-python, grpcio and protobuf ({exc}); "
        "install them with: pip install 'pollux-launch[etcd]'", name=exc.name) from exc

T = TypeVar("T")

DEFAULT_PORT = 2379
_RESULT = {"==": etcdrpc.Compare.EQUAL, "!=": etcdrpc.Compare.NOT_EQUAL,
           "<": etcdrpc.Compare.LESS, ">": etcdrpc.Compare.GREATER}
_TARGET = {"value": etcdrpc.Compare.VALUE, "mod_revision": etcdrpc.Compare.MOD,
           "create_revision": etcdrpc.Compare.CREATE}
_CHANNEL_OPTIONS = [
    # reconnect within ~1 s of a restarted server instead of gRPC's default 120 s cap
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # notice a silently dead peer; etcd refuses pings more often than every 5 s
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # etcd answers a large get_prefix in one message; gRPC's default cap is 4 MiB
    ("grpc.max_receive_message_length", 256 << 20),
]
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)
_FAILED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def parse_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """``etcd://[user:password@]host[:port][,host[:port]...]`` -> (endpoints, user, password)."""
    if not url.lower().startswith("etcd://"):
        raise StoreError(f"not an etcd store URL: {_redact(url)!r}")
    rest = url[len("etcd://"):].rstrip("/")
    user = password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, password = cred.partition(":")
    if not rest or "/" in rest or "?" in rest:
        raise StoreError(f"bad etcd store URL {_redact(url)!r}: expected "
                         "etcd://host:port[,host:port...], e.g. etcd://127.0.0.1:2379")
    endpoints = []
    for item in rest.split(","):
        host, port = item.strip(), str(DEFAULT_PORT)
        if host.startswith("["):  # [ipv6]:port
            host, _, tail = host[1:].partition("]")
            if tail:
                port = tail.removeprefix(":")
        elif ":" in host:
            host, port = host.rsplit(":", 1)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreError(f"bad etcd endpoint {item!r} in {_redact(url)!r}: "
                             "expected host:port with a port from 1 to 65535")
        endpoints.append((host, int(port)))
    return endpoints, user, password


def _redact(url: str) -> str:
    """The URL without a password."""
    head, sep, tail = url.partition("://")
    if "@" in tail:
        cred, host = tail.rsplit("@", 1)
        tail = f"{cred.partition(':')[0]}:***@{host}"
    return head + sep + tail


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise StoreError(f"etcd option {what}: cannot read {path!r} ({exc.strerror})") from None


class EtcdStore(Store):
    """A ``Store`` on an etcd v3 cluster.

    Options: ``timeout`` (seconds for every call, and for connecting), ``ca_cert``
    (PEM file: use TLS and trust this CA), ``cert_cert`` / ``cert_key`` (client
    certificate and key for mutual TLS), ``user`` / ``password`` (etcd authentication).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], prefix: str = DEFAULT_PREFIX, *,
                 timeout: float = 5.0, ca_cert: str | None = None,
                 cert_key: str | None = None, cert_cert: str | None = None,
                 user: str | None = None, password: str | None = None,
                 url: str | None = None) -> None:
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise StoreError(f"etcd option timeout must be > 0 seconds, got {timeout!r}")
        if (user is None) != (password is None):
            raise StoreError("etcd options user and password go together; give both or neither")
        if (cert_key is None) != (cert_cert is None):
            raise StoreError("etcd options cert_key and cert_cert go together (client TLS)")
        if cert_key is not None and ca_cert is None:
            raise StoreError("etcd client certificates need ca_cert too (the server's CA)")
        self.endpoints = list(endpoints)
        self.url = _redact(url or "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints))
        self.prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
        self.timeout = float(timeout)
        self._user, self._password = user, password
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        creds = None
        if ca_cert is not None:
            creds = grpc.ssl_channel_credentials(
                _read(ca_cert, "ca_cert"), _read(cert_key, "cert_key"),
                _read(cert_cert, "cert_cert"))
        self._channels = []
        for host, port in self.endpoints:
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            self._channels.append(
                grpc.secure_channel(target, creds, options=_CHANNEL_OPTIONS) if creds
                else grpc.insecure_channel(target, options=_CHANNEL_OPTIONS))
        # health from the outcome of the last call on each endpoint (not Channel.subscribe:
        # its polling thread raises once the channel is closed, grpc/grpc#18995)
        self._healthy = [True] * len(self._channels)
        self._current = 0
        self._closed = False
        try:
            # fail now, in one line, if etcd is unreachable or refuses us
            self._range(etcdrpc.RangeRequest(key=self.prefix.encode(), count_only=True),
                        "a first request")
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, **options) -> EtcdStore:
        endpoints, user, password = parse_url(url)
        options.setdefault("user", user)
        options.setdefault("password", password)
        return cls(endpoints, prefix, url=url, **options)

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r}, prefix={self.prefix!r})"

    # -- calls --------------------------------------------------------------------------

    def _channel(self) -> tuple[int, grpc.Channel]:
        """The current endpoint while it works, else the next one that has not failed."""
        n = len(self._channels)
        order = [(self._current + k) % n for k in range(n)]
        healthy = [i for i in order if self._healthy[i]]
        self._current = healthy[0] if healthy else order[1 % n]  # all failing: rotate
        return self._current, self._channels[self._current]

    def _metadata(self, channel: grpc.Channel) -> list[tuple[str, str]] | None:
        if self._user is None:
            return None
        with self._auth_lock:
            if self._token is None:
                try:
                    resp = etcdrpc.AuthStub(channel).Authenticate(
                        etcdrpc.AuthenticateRequest(name=self._user, password=self._password),
                        timeout=self.timeout, wait_for_ready=True)
                except grpc.RpcError as exc:
                    if exc.code() in _FAILED_CODES:
                        raise  # unreachable: reported by the caller
                    details = (exc.details() or "").removeprefix("etcdserver: ")
                    raise StoreError(
                        f"etcd at {self.url} refused the login of user {self._user!r}: "
                        f"{details}; check the user and password options") from None
                self._token = resp.token
            return [("token", self._token)]

    def _call(self, what: str, fn: Callable[[grpc.Channel, float, list | None], T],
              retry: bool = True) -> T:
        """Run ``fn(channel, timeout, metadata)`` within ``self.timeout``, mapping gRPC errors
        to store errors. ``retry``: the call may be repeated if a connection breaks."""
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        deadline = time.monotonic() + self.timeout
        reauth = self._user is not None
        many = len(self._channels) > 1
        while True:
            index, channel = self._channel()
            remaining = max(0.001, deadline - time.monotonic())
            if many:  # leave time to fail over from an endpoint that never connects
                remaining = min(remaining, max(0.25, self.timeout / len(self._channels)))
            try:
                result = fn(channel, remaining, self._metadata(channel))
                self._healthy[index] = True
                return result
            except grpc.RpcError as exc:
                code = exc.code()
                self._healthy[index] = code not in _FAILED_CODES
                if code == grpc.StatusCode.UNAUTHENTICATED and reauth and \
                        "invalid auth token" in (exc.details() or ""):
                    reauth = False  # the token expired or etcd restarted: log in again
                    self._token = None
                    continue
                if retry and time.monotonic() < deadline - 0.05 and (
                        code in _RETRY_CODES or (many and code in _FAILED_CODES)):
                    time.sleep(0.05 if code in _RETRY_CODES else 0)
                    continue
                raise self._error(exc, what) from None

    def _error(self, exc: grpc.RpcError, what: str,
               code: grpc.StatusCode | None = None) -> StoreError:
        code, details = code or exc.code(), (exc.details() or "").removeprefix("etcdserver: ")
        if code == grpc.StatusCode.UNKNOWN and "deadline exceeded" in details:
            code = grpc.StatusCode.DEADLINE_EXCEEDED  # etcd's side saw our deadline first
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return StoreUnavailable(
                f"etcd at {self.url} did not answer {what} within {self.timeout:g} s "
                f"({code.name.lower()}); check that etcd runs and is reachable from this "
                "host (URL, firewall, TLS options), or raise the timeout option")
        if "lease not found" in details:
            return LeaseExpired(f"{what}: the lease has expired or was revoked; grant a new one")
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
            return StoreCompacted(f"etcd at {self.url}: {details}; re-read the keys, then "
                                  "wait from revision()")
        if "user name is empty" in details:
            return StoreError(f"etcd at {self.url} requires authentication; pass the user "
                              "and password options")
        if "authentication failed" in details or code in (
                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return StoreError(f"etcd at {self.url} refused {what}: {details}; check the user "
                              "and password options and the user's role")
        if "authentication is not enabled" in details:
            return StoreError(f"etcd at {self.url}: authentication is not enabled on the "
                              "server; drop the user and password options")
        return StoreError(f"etcd at {self.url}: {what} failed: {code.name}: {details}")

    def _key(self, key: str) -> bytes:
        return (self.prefix + check_key(key)).encode()

    def _kv(self, kv) -> KeyValue:
        return KeyValue(_text(kv.key)[len(self.prefix):], _text(kv.value),
                        kv.create_revision, kv.mod_revision, kv.lease)

    def _range(self, req: etcdrpc.RangeRequest, what: str):
        return self._call(what, lambda ch, t, md: etcdrpc.KVStub(ch).Range(
            req, timeout=t, metadata=md, wait_for_ready=True))

    # -- the Store interface --------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        resp = self._range(etcdrpc.RangeRequest(key=self._key(key)), "get")
        return self._kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        lo = self.prefix + check_key(prefix)
        req = etcdrpc.RangeRequest(key=lo.encode(), range_end=prefix_end(lo).encode(),
                                   sort_order=etcdrpc.RangeRequest.ASCEND,
                                   sort_target=etcdrpc.RangeRequest.KEY)
        return [self._kv(kv) for kv in self._range(req, "get_prefix").kvs]

    def put(self, key: str, value: str, lease: int = 0) -> int:
        req = etcdrpc.PutRequest(key=self._key(key), value=check_value(value).encode(),
                                 lease=lease)
        resp = self._call("put", lambda ch, t, md: etcdrpc.KVStub(ch).Put(
            req, timeout=t, metadata=md, wait_for_ready=True))
        return resp.header.revision

    def _delete_request(self, key: str, prefix: bool) -> etcdrpc.DeleteRangeRequest:
        full = self.prefix + check_key(key)
        if prefix:
            return etcdrpc.DeleteRangeRequest(key=full.encode(),
                                              range_end=prefix_end(full).encode())
        return etcdrpc.DeleteRangeRequest(key=full.encode())

    def delete(self, key: str, prefix: bool = False) -> int:
        req = self._delete_request(key, prefix)
        resp = self._call("delete", lambda ch, t, md: etcdrpc.KVStub(ch).DeleteRange(
            req, timeout=t, metadata=md, wait_for_ready=True), retry=False)
        return resp.deleted

    def _op(self, op: Put | Delete) -> etcdrpc.RequestOp:
        if isinstance(op, Put):
            return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                key=self._key(op.key), value=op.value.encode(), lease=op.lease))
        return etcdrpc.RequestOp(request_delete_range=self._delete_request(op.key, op.prefix))

    def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
            failure: Sequence[Put | Delete] = ()) -> bool:
        cmps = []
        for c in compare:
            check_compare(c)
            cmp = etcdrpc.Compare(key=self._key(c.key), result=_RESULT[c.op],
                                  target=_TARGET[c.target])
            if c.target == "value":
                cmp.value = c.operand.encode()
            elif c.target == "mod_revision":
                cmp.mod_revision = c.operand
            else:
                cmp.create_revision = c.operand
            cmps.append(cmp)
        check_ops(success)
        check_ops(failure)
        req = etcdrpc.TxnRequest(compare=cmps, success=[self._op(o) for o in success],
                                 failure=[self._op(o) for o in failure])
        resp = self._call("txn", lambda ch, t, md: etcdrpc.KVStub(ch).Txn(
            req, timeout=t, metadata=md, wait_for_ready=True), retry=False)
        return resp.succeeded

    def lease_grant(self, ttl: float) -> int:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise StoreError(f"lease TTL must be a positive number of seconds, got {ttl!r}")
        # etcd counts whole seconds and raises short TTLs to its minimum (1.5 x election
        # timeout, 2 s with etcd's defaults)
        req = etcdrpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)), ID=0)
        resp = self._call("lease_grant", lambda ch, t, md: etcdrpc.LeaseStub(ch).LeaseGrant(
            req, timeout=t, metadata=md, wait_for_ready=True))
        if resp.error:
            raise StoreError(f"etcd at {self.url}: lease_grant failed: {resp.error}")
        return resp.ID

    def lease_refresh(self, lease: int) -> None:
        req = etcdrpc.LeaseKeepAliveRequest(ID=lease)

        def call(ch: grpc.Channel, t: float, md: list | None) -> int:
            stream = etcdrpc.LeaseStub(ch).LeaseKeepAlive(
                iter([req]), timeout=t, metadata=md, wait_for_ready=True)
            try:
                return next(stream).TTL
            except StopIteration:
                return 0
            finally:
                stream.cancel()
        if self._call("lease_refresh", call) <= 0:
            raise LeaseExpired(f"lease {lease:x} has expired or was revoked; grant a new one "
                               "and re-put its keys")

    def lease_revoke(self, lease: int) -> None:
        req = etcdrpc.LeaseRevokeRequest(ID=lease)
        try:
            self._call("lease_revoke", lambda ch, t, md: etcdrpc.LeaseStub(ch).LeaseRevoke(
                req, timeout=t, metadata=md, wait_for_ready=True))
        except LeaseExpired:
            pass  # already gone: revoking is idempotent

    # -- scoped users (etcd auth: a user and a role of the same name) ---------------------

    def scoped_credentials(self, name: str, readwrite: Sequence[str],
                           read: Sequence[str]) -> tuple[str, str] | None:
        if self._user is None:  # an etcd without auth, or one we reach without a login
            return None
        user = self.prefix + check_key(name)  # one per cluster prefix
        password = secrets.token_urlsafe(24)
        perms = [(etcdrpc.Permission.READWRITE, p) for p in readwrite]
        perms += [(etcdrpc.Permission.READ, p) for p in read]

        def grant(channel: grpc.Channel, timeout: float, md: list | None) -> None:
            auth = etcdrpc.AuthStub(channel)
            _create(lambda: auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=user),
                                         timeout=timeout, metadata=md))
            for kind, prefix in perms:
                lo = self.prefix + check_key(prefix)
                auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(
                    name=user, perm=etcdrpc.Permission(permType=kind, key=lo.encode(),
                                                       range_end=prefix_end(lo).encode())),
                    timeout=timeout, metadata=md)
            # revision() and the first request read the prefix's own key, count only
            auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(
                name=user, perm=etcdrpc.Permission(permType=etcdrpc.Permission.READ,
                                                   key=self.prefix.encode())),
                timeout=timeout, metadata=md)
            if not _create(lambda: auth.UserAdd(etcdrpc.AuthUserAddRequest(
                    name=user, password=password), timeout=timeout, metadata=md)):
                auth.UserChangePassword(etcdrpc.AuthUserChangePasswordRequest(
                    name=user, password=password), timeout=timeout, metadata=md)
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=user),
                               timeout=timeout, metadata=md)

        self._call(f"making the scoped user {user!r}", grant)
        return user, password

    def drop_scoped_credentials(self, name: str) -> None:
        if self._user is None:
            return
        user = self.prefix + check_key(name)

        def drop(channel: grpc.Channel, timeout: float, md: list | None) -> None:
            auth = etcdrpc.AuthStub(channel)
            for call in (lambda: auth.UserDelete(etcdrpc.AuthUserDeleteRequest(name=user),
                                                 timeout=timeout, metadata=md),
                         lambda: auth.RoleDelete(etcdrpc.AuthRoleDeleteRequest(role=user),
                                                 timeout=timeout, metadata=md)):
                try:
                    call()
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise  # (FAILED_PRECONDITION: already gone - nothing to drop)

        self._call(f"removing the scoped user {user!r}", drop)

    def revision(self) -> int:
        req = etcdrpc.RangeRequest(key=self.prefix.encode(), count_only=True)
        return self._range(req, "revision").header.revision

    def wait(self, prefix: str, after_revision: int, timeout: float) -> list[Event]:
        lo = self.prefix + check_key(prefix)
        create = etcdrpc.WatchCreateRequest(key=lo.encode(), range_end=prefix_end(lo).encode(),
                                            start_revision=after_revision + 1)
        deadline = time.monotonic() + max(0.05, timeout)  # time to create the watch at all
        while True:
            remaining = deadline - time.monotonic()
            index, channel = self._channel()
            created = threading.Event()
            try:
                return self._watch_once(index, channel, create, remaining, created)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                # the deadline shows as DEADLINE_EXCEEDED, or as UNKNOWN when etcd's side
                # of the stream noticed it first
                timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED or (
                    code == grpc.StatusCode.UNKNOWN and "deadline exceeded" in details)
                if timed_out and (created.is_set() or self._healthy[index]):
                    return []  # connected, and nothing happened in time
                if timed_out or code in _FAILED_CODES:
                    self._healthy[index] = False
                if code in _RETRY_CODES and time.monotonic() < deadline - 0.05:
                    time.sleep(0.05)  # the connection broke: watch again from the same revision
                    continue
                if timed_out:
                    code = grpc.StatusCode.DEADLINE_EXCEEDED
                raise self._error(exc, "wait", code) from None

    def _watch_once(self, index: int, channel: grpc.Channel,
                    create: etcdrpc.WatchCreateRequest, timeout: float,
                    created: threading.Event) -> list[Event]:
        done = threading.Event()

        def requests() -> Iterator[etcdrpc.WatchRequest]:
            yield etcdrpc.WatchRequest(create_request=create)
            done.wait()  # closing the request stream would end the watch

        stream = etcdrpc.WatchStub(channel).Watch(
            requests(), timeout=timeout, metadata=self._metadata(channel), wait_for_ready=True)
        try:
            for resp in stream:
                if resp.compact_revision:
                    raise StoreCompacted(
                        f"etcd at {self.url} keeps history after revision "
                        f"{resp.compact_revision} only, asked for changes after "
                        f"{create.start_revision - 1}: re-read the keys, then wait from "
                        "revision()")
                if resp.canceled:
                    raise StoreError(f"etcd at {self.url} cancelled the watch: "
                                     f"{resp.cancel_reason}")
                if resp.created:
                    created.set()
                    self._healthy[index] = True
                if resp.events:
                    n = len(self.prefix)
                    return [Event("delete" if e.type == 1 else "put", _text(e.kv.key)[n:],
                                  "" if e.type == 1 else _text(e.kv.value), e.kv.mod_revision)
                            for e in resp.events]
            return []
        finally:
            done.set()
            stream.cancel()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ch in self._channels:
            ch.close()


def _text(raw: bytes) -> str:
    """Any bytes someone put in etcd, as text: undecodable bytes become surrogates, which
    the message layer refuses as not UTF-8 (``pollux_launch.messages.decode``)."""
    return raw.decode("utf-8", "surrogateescape")


def _create(call: Callable[[], object]) -> bool:
    """Run an etcd auth "add" call; False if what it adds exists already (etcd answers
    FAILED_PRECONDITION for an existing user or role)."""
    try:
        call()
        return True
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return False
