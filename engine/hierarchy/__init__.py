"""The expert memory hierarchy: host pool, device expert cache, q* split and CPU expert workers.

DESIGN.md 2.1–2.3: every expert lives in the host pool; the executor's device keeps a global LRU
cache of expert slots; each step's misses are split between cache fills and CPU execution by the
exact integer q* rule. Results never depend on the cache size, only speed does.
"""
