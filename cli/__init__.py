"""The ``hearth`` command line. Single-machine commands never import Ray; ``up``, ``status`` and
``down`` import it when they run."""
