"""Whether the store lost everything since a service last looked: the cluster's *epoch*.

``cluster/epoch`` holds a random token, created by the first service that finds it
missing (create-if-absent: one token wins). A service remembers the token it saw; when
the key is gone or holds another token, the store it talks to is not the one it knew -
its data directory was wiped, or a new, empty store took its place - and what the
service fenced by the old store's numbers (allocation terms and versions) must start
afresh. A store restarted on its data keeps its epoch. Services look after they had to
register again (a lost lease: the only way a wiped store shows itself to a client), so
looking costs nothing while all is well.
"""

from __future__ import annotations

import json
import secrets

from .. import keys
from ..rendezvous.store import Store


class Epoch:
    def __init__(self) -> None:
        self.seen: str | None = None

    def changed(self, store: Store) -> bool:
        """Look (creating the epoch where there is none): True when it is not the one
        seen last time (never on the first look). Raises StoreError."""
        kv = store.get(keys.EPOCH)
        if kv is None:
            store.create(keys.EPOCH, json.dumps(secrets.token_hex(8)))
            kv = store.get(keys.EPOCH)
        token = kv.value[:64] if kv is not None else ""
        changed = self.seen is not None and token != self.seen
        self.seen = token
        return changed
