"""hearth on Ray: per-machine actors, the router and the command line (``hearth``)."""
