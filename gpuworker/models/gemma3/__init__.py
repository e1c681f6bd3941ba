"""Gemma 3's text decoder (Gemma3ForCausalLM): its config layout and its model."""
