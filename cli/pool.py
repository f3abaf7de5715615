"""``hearth pool``: list or remove the shared-memory expert pools on this machine."""

from __future__ import annotations

import argparse

from hearth.engine.experts import cleanup_pool, list_pools


def cmd_pool(args: argparse.Namespace) -> int:
    """``hearth pool list|clean [NAME]``."""
    pools = list_pools()
    if args.action == "list":
        for p in pools:
            state = "owner alive" if p["owner_alive"] else "owner gone"
            print(f"{p['name']}  {p['bytes'] / 2**20:.1f} MiB  pid {p['owner_pid']} ({state})")
        if not pools:
            print("no hearth shared-memory pools")
        return 0
    names = [args.name] if args.name else [p["name"] for p in pools if not p["owner_alive"]]
    for name in names:
        print(f"{'removed' if cleanup_pool(name) else 'not found'}: {name}")
    return 0
