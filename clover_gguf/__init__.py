"""clover-gguf: Clover block-diffusion MoE to GGUF, a patched llama.cpp, and block decoding on it."""

__version__ = "0.1.0"
