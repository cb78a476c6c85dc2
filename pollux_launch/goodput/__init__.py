"""goodput (see README.md)."""
