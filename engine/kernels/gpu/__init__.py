"""Triton kernels of captured decode steps: fixed grids, no host reads, so a CUDA graph replays them.
Triton is optional (imported when a kernel is first built); on a machine without a GPU the same
kernels run under Triton's interpreter in the tests."""
