"""The expert subsystem: every expert in the host pool, a device cache of expert slots, each layer
call's misses split between cache fills and CPU execution by the q* table, and prefill streamed
through whole-layer buffers. Results never depend on the cache size or the split, only speed does
(``docs/design.md``: the expert memory hierarchy).

- ``contract.py``   what the model, the engine and the cluster rely on (protocols, step context)
- ``pool.py``       the expert pool by global id; ``compute.py`` expert math and the plain backend
- ``policy/``       decisions: the q* table, its online tuning, cache control, when to stream
- ``mechanism/``    how they happen: devices, CPU workers, the task ring, shared memory, the host
  pool, the layer streamer
- ``backend.py``, ``measure.py``, ``build.py``  the hierarchical backend, the path measurements, and
  the assembly from an :class:`~hearth.config.ExpertConfig`
"""
