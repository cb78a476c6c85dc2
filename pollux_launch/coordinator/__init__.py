"""coordinator (see README.md)."""
