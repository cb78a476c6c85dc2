"""agent (see README.md)."""
