"""Checkpoint formats and loading: Hugging Face safetensors directories (:mod:`.loader`, quantized
ones through :mod:`.hf_quant`), GGUF files (:mod:`.gguf_file`, :mod:`.gguf_loader`,
:mod:`.gguf_writer`), hearth's FTW directories (:mod:`.ftw`), what a checkpoint holds
(:mod:`.inspect`) and the bundled demo model (:mod:`.demo`)."""
