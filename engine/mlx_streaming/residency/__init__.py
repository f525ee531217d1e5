"""The resident expert pool: slots, eviction, pinning, statistics."""
