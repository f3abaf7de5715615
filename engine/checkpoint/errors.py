"""The error every checkpoint reader raises for tensors that do not match the config (its own
module, so the readers need not import one another for it)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match what its config describes."""
