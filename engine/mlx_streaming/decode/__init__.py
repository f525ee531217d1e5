"""The decode loops: greedy (the oracle and the engine share it), mlx-lm's ``generate_step`` with its signature
and semantics, and the one protocol both follow (``ahead``)."""
