"""What a peer's failure looks like as text: one answer for the workers' failure check
(``elastic/failures.py``) and the node agents that read a failed worker's recorded error
(torchrun's error file, ``launcher/drivers.py``). Torch-free, so that node agents need
not import torch.

torch types a peer's failure for NCCL and the TCPStore (``torch.distributed.DistError``
and its subclasses), but gloo (torch 2.13) raises a bare ``RuntimeError`` whose text
names the transport error: read/write errors, closed or reset connections, timeouts
(its pair.cc and unbound_buffer.cc).
"""

from __future__ import annotations

# torch.distributed.DistError and its subclasses (torch 2.13): a peer's failure by type
DIST_ERROR_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
GLOO_WORDS = ("connection", "peer", "gloo", "timed out", "timeout", "broken pipe", "closed",
              "reset")


def gloo_says_peer_failed(text: str) -> bool:
    """Whether a bare RuntimeError's ``text`` names gloo's transport losing a peer."""
    text = text.lower()
    return any(w in text for w in GLOO_WORDS)


def recorded_peer_failure(message: str) -> bool:
    """Whether an error recorded as ``"<Type>: <text>"`` (torchrun's error file, written
    by ``@record``) is a collective's failure caused by a peer."""
    kind, sep, text = message.partition(":")
    if not sep:
        return False
    kind = kind.strip().rsplit(".", 1)[-1]
    return kind in DIST_ERROR_TYPES or (kind == "RuntimeError" and gloo_says_peer_failed(text))
