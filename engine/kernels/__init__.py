"""Hand-written kernels, by where they run.

- :mod:`hearth.engine.kernels.cpu`: the native CPU kernels (C++ behind a C ABI, one library per
  instruction set, built at install) and their loader.
- :mod:`hearth.engine.kernels.gpu`: the Triton kernels of captured decode steps (the device share of
  the experts, the count-aware pool fill, the task ring's post and collect).
- :mod:`hearth.engine.kernels.ring_words`: the task ring's control words, which the GPU ring kernels
  and the host ring (``experts/mechanism/ring.py``) both follow.

Nothing here imports from ``experts/``: what the two share lives here, below both.
"""
