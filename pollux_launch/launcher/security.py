"""Job-spec signing: node agents run only specs signed with the cluster's shared secret.

The secret comes from a file (``--secret-file``) or the ``POLLUX_SECRET`` environment
variable; it is never logged and never written to the store. A spec's signature is the
hex HMAC-SHA256 of the spec's exact JSON text, stored beside it
(``jobs/<job>/signature``); agents recompute and compare in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path

from pollux_launch.errors import UserError

from .. import env as envvars

log = logging.getLogger(__name__)

SECRET_ENV, SECRET_FILE_ENV = envvars.SECRET, envvars.SECRET_FILE


class SecretError(UserError, ValueError):
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
        _warn_if_shared(path)
        return secret
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def sign(spec_text: str, secret: bytes) -> str:
    return hmac.new(secret, spec_text.encode(), hashlib.sha256).hexdigest()


def verify(spec_text: str, signature: str | None, secret: bytes) -> bool:
    return signature is not None and hmac.compare_digest(sign(spec_text, secret), signature)


def _warn_if_shared(path: str) -> None:
    """One warning line when others than its owner may read or write the secret file
    (ssh's "UNPROTECTED PRIVATE KEY FILE"): whoever reads it can sign specs that every
    agent runs, and whoever writes it can set a secret of their own. Warned, not refused
    as ssh does: a cluster's services often share the secret as a group-readable file
    (0640) on a shared folder, and refusing would stop every agent of such a cluster at
    its next start, while the warning names the fix."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # (read a moment ago; gone now: nothing to say about its mode)
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret file %s is accessible by group or others (mode %04o): anyone "
                    "who can read it can sign jobs that every agent runs; chmod 600 %s",
                    path, stat.S_IMODE(mode), path)


def without_secrets(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less the operator's secrets (for every process a job runs)."""
    return {k: v for k, v in environ.items() if k not in envvars.SECRETS}
