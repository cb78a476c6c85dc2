"""Job-spec signing: node agents run only specs signed with the cluster's shared secret.

The secret comes from a file (``--secret-file``) or the ``POLLUX_SECRET`` environment
variable; it is never logged and never written to the store. A spec's signature is the
hex HMAC-SHA256 of the spec's exact JSON text, stored beside it
(``jobs/<job>/signature``); agents recompute and compare in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from .. import env as envvars

SECRET_ENV, SECRET_FILE_ENV = envvars.SECRET, envvars.SECRET_FILE


class SecretError(ValueError):
    """The secret could not be loaded (the message never contains the secret)."""


def load_secret(path: str | None = None) -> bytes | None:
    """The cluster secret from ``path``, $POLLUX_SECRET_FILE or $POLLUX_SECRET; None if unset."""
    path = path or os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise SecretError(f"secret file {path}: cannot read it ({exc.strerror})") from None
        if not secret:
            raise SecretError(f"secret file {path} is empty; put a long random string in it")
        return secret
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def sign(spec_text: str, secret: bytes) -> str:
    return hmac.new(secret, spec_text.encode(), hashlib.sha256).hexdigest()


def verify(spec_text: str, signature: str | None, secret: bytes) -> bool:
    return signature is not None and hmac.compare_digest(sign(spec_text, secret), signature)
