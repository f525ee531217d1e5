"""Qwen3-Next's multi-token-prediction head and self-speculative decoding."""
