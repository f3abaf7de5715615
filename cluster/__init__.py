"""hearth on Ray: per-machine actors, the router and the command line (``hearth``).

``cluster.connect(address)`` returns a client of a running deployment (see ``cluster.sdk``).
"""

from __future__ import annotations

from typing import Any


def connect(address: str = "auto") -> Any:
    """A :class:`cluster.sdk.HearthClient` of the deployment on the cluster at ``address``."""
    from cluster.sdk import connect as _connect

    return _connect(address)
