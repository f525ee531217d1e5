"""Memory snapshots and their breakdown."""
