"""hearth: exact mixture-of-experts inference on the machines people already own.

The package's rooms, by role (``docs/design.md`` draws who may import whom):

- :mod:`hearth.engine`  single-machine inference (no Ray, no serving);
- :mod:`hearth.serving` the OpenAI, Anthropic and gRPC APIs over an engine client (no Ray);
- :mod:`hearth.cluster` Ray actors, the router, placement and deployment;
- :mod:`hearth.proto`   the contracts that cross process boundaries and their gRPC form (no torch);
- :mod:`hearth.cli`     the ``hearth`` command.

``import hearth`` is cheap: it loads none of them.
"""

__version__ = "0.1.0"
