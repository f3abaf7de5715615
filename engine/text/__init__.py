"""Text in and text out: what turns a request's text into token ids and the sampled ids back into
text, and what keeps the output inside a grammar.

- :mod:`.tokenizer`: :func:`~.tokenizer.load_tokenizer` (the checkpoint's own tokenizer, never
  downloaded) and :func:`~.tokenizer.render_chat` (its chat template; ``templates/`` holds hearth's
  own for architectures whose checkpoints ship none).
- :mod:`.detokenizer`: :class:`~.detokenizer.IncrementalDetokenizer`, text deltas that never split
  a UTF-8 character.
- :mod:`.grammar`: constrained decoding (:class:`~.grammar.Grammars`, the per-step logit masks;
  :func:`~.grammar.json_schema_grammar` and :data:`~.grammar.JSON_STYLE`, which serving builds
  request grammars with).

They sit apart from the loop (``llm_engine``, ``scheduler``) because they depend on the tokenizer
alone, not on the model or its caches, and serving uses them on its own. This ``__init__`` imports
nothing: each module loads its heavy dependency (transformers, llguidance) only when first needed.
"""
