"""Expert tensor names in a Hugging Face checkpoint (after the family's name mapping), shared by the
float loader (:mod:`.loader`) and the quantized one (:mod:`.hf_quant`)."""

from __future__ import annotations

import re

# ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``: one expert's matrix.
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# ``model.layers.{l}.mlp.experts.{gate_up,down}_proj``: every expert of a layer in one tensor.
FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
