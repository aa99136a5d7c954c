"""The error of the weight-transfer system, below every module that raises it
(``base`` re-exports it; ``deadlines`` raises it for a peer that stops answering)."""

from __future__ import annotations


class WeightTransferError(RuntimeError):
    """A sync round or a rendezvous failed; the message says what to fix."""
