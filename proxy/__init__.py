"""vllm-lifeguard."""

__version__ = "0.1.0"
