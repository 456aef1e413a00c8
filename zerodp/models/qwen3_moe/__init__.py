"""The qwen3_moe family: spec.py (torch-free: names, shapes, the Hugging Face mapping, presets) and
model.py (the module). Importing this package imports no torch."""
