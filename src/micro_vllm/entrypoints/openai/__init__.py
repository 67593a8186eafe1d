"""The OpenAI-compatible server: `micro-vllm serve`."""
