"""The executor: where a scheduled step runs, on the CPU or as the GPU executor (the device the dense
weights, the KV cache and sampling live on).

- :mod:`.runner`: :class:`~.runner.ModelRunner` turns a scheduled step into a batch, runs the model
  (or hands a pure decode step to the fixed-shape decoder) and returns the logits;
  :func:`~.runner.build_batch` flattens the step.
- :mod:`.fixed_shape`: :class:`~.fixed_shape.StaticDecoder`, decode steps in fixed-shape buckets
  that compile whole and that a GPU captures as a CUDA graph.
- :mod:`.graph_ops`: the ``torch.ops.hearth.*`` custom ops those steps are built from (importing
  it registers them).
- :mod:`.device_placement`: which device runs the dense part, and moving a model there.
- :mod:`.memory_plan`: what the engine holds where (:class:`~.memory_plan.MemoryPlan`, the VRAM
  plan).

What a model forward reads (the batch types, :mod:`hearth.engine.layers.batch`) and a decode step's
layers as native calls (:mod:`hearth.engine.layers.native`) sit below, in ``layers/``: the layers
and models never import the executor. The public face is these modules' named classes and
functions, imported from the modules themselves; this ``__init__`` imports nothing.
"""
