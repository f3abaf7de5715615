"""The serving layer: OpenAI and Anthropic HTTP APIs and a gRPC service over an engine client.

The API layer never touches the engine directly: it renders prompts (chat template, tools),
sends token ids through an :class:`~cluster.serving.client.EngineClient`, and turns the stream of
:class:`~cluster.serving.client.GenerationChunk` back into each protocol. The in-process client
runs the engine loop in a thread; the cluster's router will use remote clients with the same
contract.
"""
