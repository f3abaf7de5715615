"""Building blocks shared by every model family, what a forward reads (:mod:`.batch`) and a CPU
decode step's standard layers as one native call each (:mod:`.native`)."""
