"""The expert hierarchy's decisions: the q* split, its fill credit, cache control, when to stream."""
