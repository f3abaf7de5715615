"""Block-quantized weights: what a format declares (``block.py``), one module per format
(``formats/``), the registry that lists them (``registry.py``), and their torch encode and decode."""
