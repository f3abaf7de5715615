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

# The native kernels and torch share one OpenMP thread pool. Between two kernels of a decode step
# (tens of microseconds of Python) GNU OpenMP's idle threads would otherwise go to sleep and be
# woken for every call; spinning ~1 ms first keeps them ready through a step (+12 % decode on a
# 2-core machine) while an idle server still sleeps. Takes effect when hearth is imported before
# torch; a value the user set wins.
import os as _os  # noqa: E402

_os.environ.setdefault("GOMP_SPINCOUNT", "1000000")
del _os
