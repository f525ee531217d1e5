"""Reading and writing checkpoints in the public MLX / Hugging Face layouts."""

#: The MTP head's file in a model folder (``mlx_lm.convert`` drops the head; ``extract-mtp`` writes it here).
MTP_FILE = "mtp.safetensors"
