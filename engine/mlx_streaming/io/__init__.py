"""Bytes from disk: batched positional reads with or without the page cache."""
