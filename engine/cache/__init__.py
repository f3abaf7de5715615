"""What an engine keeps of the sequences between steps: the KV pages, the prefix tree over them,
and a hybrid model's recurrent states and their checkpoints.

- :mod:`.kv_pages`: :class:`~.kv_pages.BlockAllocator` (block ids, pure bookkeeping) and
  :class:`~.kv_pages.PagedKVCache` (the per-layer K/V tensors those ids index).
- :mod:`.prefix_tree`: :class:`~.prefix_tree.RadixCache`, cached prompt prefixes as whole KV
  blocks, reused across requests (pure bookkeeping).
- :mod:`.state_slots`: :class:`~.state_slots.RecurrentStatePool`, one recurrent-state slot per
  running sequence of a hybrid model, and :class:`~.state_slots.StateSnapshot`.
- :mod:`.state_checkpoints`: :class:`~.state_checkpoints.CheckpointStore`, snapshots of those
  states hung on the prefix tree under a byte budget, and where to take them.
- :mod:`.anchors`: the chat-template tokens that checkpoints are taken around.

The scheduler does the bookkeeping with them; the runner and the model read and write the tensors.
The public face is those modules' named classes and functions, imported from the modules
themselves (this ``__init__`` imports nothing, like the executor's).
"""
