"""hearth on Ray: per-machine actors, the router, placement and deployment.

``hearth.cluster.connect(address)`` returns a client of a running deployment (see
:mod:`hearth.cluster.sdk`).
"""

from __future__ import annotations

from typing import Any


def connect(address: str = "auto") -> Any:
    """A :class:`hearth.cluster.sdk.HearthClient` of the deployment on the cluster at ``address``."""
    # deferred: the client needs Ray; placement, routing and stages are pure and imported without it
    from hearth.cluster.sdk import connect as _connect

    return _connect(address)
