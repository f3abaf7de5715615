"""The serving layer: OpenAI and Anthropic HTTP APIs and a gRPC service over an engine client.

The API layer never touches the engine directly: it renders prompts (chat template, tools),
sends token ids through an :class:`~hearth.proto.contracts.EngineClient`, and turns the stream of
:class:`~hearth.proto.contracts.GenerationChunk` back into each protocol. The in-process client
(:mod:`hearth.serving.client`) runs an engine in a thread; the cluster's router implements the same
contract over its replicas. Nothing here imports Ray.
"""
