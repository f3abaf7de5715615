"""The task ring's control words: what the executor, the CPU expert worker (another process) and the
GPU ring kernels agree on. The host side is ``experts/mechanism/ring.py`` (and its worker), the device
side ``kernels/gpu/device_ring.py``; both import these, so neither imports the other.

Each slot starts with eight int64 control words: state, sequence number, tokens, top-k, fp32 weights
(0/1), expert bytes read, nanoseconds taken (the worker's), and a GPU step's error word. The state
word is written last by whoever hands the slot over (aligned 8-byte stores, ordered after the
payload), and read first.
"""

from __future__ import annotations

# The state word (ctrl[0]): FREE -> SUBMITTED (the executor posted a task) -> DONE or FAILED (the
# worker answered) -> FREE (the executor collected it).
FREE, SUBMITTED, DONE, FAILED = 0, 1, 2, 3
ERROR_WORD = 7  # ctrl[7]: a GPU step's error code (kernels/gpu/device_ring.py), 0 when none
