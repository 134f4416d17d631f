"""A checkpoint out of hftrain's hands: one standard HF model directory from any backend's checkpoint, a LoRA adapter
merged or kept (model_dir.py), and one GGUF file for llama.cpp (gguf_file.py)."""
