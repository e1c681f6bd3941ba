"""Qwen2.5-VL: a windowed vision transformer whose merged patches replace the prompt's image tokens,
and the Qwen2 text decoder with multimodal rotary positions."""
