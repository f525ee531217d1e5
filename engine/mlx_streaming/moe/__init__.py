"""The streaming MoE block."""
