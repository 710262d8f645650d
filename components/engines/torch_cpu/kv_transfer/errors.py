"""Errors of the KV transfer layer; callers catch :class:`TransferError` to fall back."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer did not complete; the decode side should prefill locally."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer, a staging grant or an awaited arrival did not finish in time."""


class PeerNotFound(TransferError):
    """The peer's agent record is not in etcd (never started, or closed)."""


class StagingFull(TransferError):
    """The receiver's staging pool has no free region of the requested size."""


class LayoutMismatch(ValueError):
    """Two KV pools cannot exchange blocks at all (different layers, head dim, dtype...)."""
