"""Offline export of a checkpoint: one safetensors file or a Hugging Face model directory."""
