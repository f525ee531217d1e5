"""Reading and writing checkpoints in the public MLX / Hugging Face layouts."""
