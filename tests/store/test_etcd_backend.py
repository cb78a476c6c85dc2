"""etcd-only behaviour: restarts, unreachable servers, TLS, authentication, secrets."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from pyetcd import etcdrpc

from pollux_launch.rendezvous.store import (
    Event,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
    open_store,
)
from pollux_launch.rendezvous.store.etcd import parse_url


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_same_store_object_survives_an_etcd_restart(etcd_private):
    store = open_store(etcd_private.url, "/restart", timeout=2)
    store.put("before", '"kept"')
    lease = store.lease_grant(60)
    store.put("leased", "1", lease=lease)
    rev = store.revision()

    # a wait in flight while etcd is down reconnects and sees the write made after
    seen: list[list[Event]] = []
    waiter = threading.Thread(target=lambda: seen.append(store.wait("after", rev, 30)))
    waiter.start()
    etcd_private.kill()
    with pytest.raises(StoreUnavailable, match=etcd_private.url.split("//")[1]) as info:
        store.get("before")
    assert "\n" not in str(info.value)
    etcd_private.start()

    assert store.get("before").value == '"kept"'  # the data dir survived
    r = store.put("after", '"new"')
    waiter.join(30)
    assert seen == [[Event("put", "after", '"new"', r)]]
    store.lease_refresh(lease)  # leases survive a restart (etcd extends their TTL)
    assert store.get("leased").lease == lease
    assert store.create("again", "1") and store.revision() == r + 1
    store.close()


def test_unreachable_etcd_fails_in_one_line_after_the_timeout():
    url = f"etcd://127.0.0.1:{_dead_port()}"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url, timeout=0.5)
    msg = str(info.value)
    assert url in msg and "timeout" in msg and "\n" not in msg


def test_urls_are_parsed_and_passwords_never_shown():
    assert parse_url("etcd://a:1,b,[::1]:3") == ([("a", 1), ("b", 2379), ("::1", 3)], None, None)
    assert parse_url("etcd://u:pw@h:5")[1:] == ("u", "pw")
    for bad in ("etcd://", "etcd://h:0", "etcd://h:x", "etcd://h:1/path", "etcd://h:1,,"):
        with pytest.raises(StoreError):
            parse_url(bad)
    with pytest.raises(StoreUnavailable) as info:
        open_store(f"etcd://bob:s3cret@127.0.0.1:{_dead_port()}", timeout=0.3)
    assert "s3cret" not in str(info.value) and "bob:***@" in str(info.value)
    with pytest.raises(StoreError, match="go together"):
        open_store("etcd://127.0.0.1:1", user="bob")
    with pytest.raises(StoreError, match="cannot read"):
        open_store("etcd://127.0.0.1:1", ca_cert="/nonexistent/ca.pem")


def test_authentication(etcd_private):
    auth = etcdrpc.AuthStub(grpc.insecure_channel(f"127.0.0.1:{etcd_private.client_port}"))
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="pw-root"), timeout=5)
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)

    with open_store(etcd_private.url, "/auth", user="root", password="pw-root") as store:
        store.put("k", "1")
        etcd_private.restart()  # the server forgets its tokens: the store logs in again
        assert store.get("k").value == "1"
    with pytest.raises(StoreError) as info:
        open_store(etcd_private.url, user="root", password="wrong-pw", timeout=2)
    assert not isinstance(info.value, StoreUnavailable)
    assert "wrong-pw" not in str(info.value) and "password" in str(info.value)
    with pytest.raises(StoreError) as info:
        open_store(etcd_private.url, timeout=2)
    assert not isinstance(info.value, StoreUnavailable)


def test_tls_with_client_certificates(etcd_factory, etcd_certs):
    server = etcd_factory(tls=etcd_certs)
    with open_store(server.url, "/tls", ca_cert=str(etcd_certs / "ca.pem"),
                    cert_cert=str(etcd_certs / "client.pem"),
                    cert_key=str(etcd_certs / "client.key")) as store:
        store.put("k", "1")
        assert store.get("k").value == "1"
    with pytest.raises(StoreUnavailable):  # plain gRPC to a TLS port never connects
        open_store(server.url, timeout=1)
    with pytest.raises(StoreUnavailable):  # TLS without a client certificate is refused
        open_store(server.url, ca_cert=str(etcd_certs / "ca.pem"), timeout=1)


def test_wait_on_compacted_history_says_so(etcd_server):
    with open_store(etcd_server.url, "/compact") as store:
        first = store.put("k", "1")
        last = store.put("k", "2")
        kv = etcdrpc.KVStub(grpc.insecure_channel(f"127.0.0.1:{etcd_server.client_port}"))
        kv.Compact(etcdrpc.CompactionRequest(revision=last), timeout=5)
        with pytest.raises(StoreCompacted, match="re-read"):
            store.wait("", first - 1, 1)
        assert store.wait("", last - 1, 1)[0].value == "2"


def test_fails_over_to_a_live_endpoint(etcd_server):
    url = f"etcd://127.0.0.1:{_dead_port()},127.0.0.1:{etcd_server.client_port}"
    with open_store(url, "/failover", timeout=2) as store:
        rev = store.put("k", "1")
        assert store.get("k").value == "1"
        assert store.wait("", rev - 1, 1)[0].key == "k"
