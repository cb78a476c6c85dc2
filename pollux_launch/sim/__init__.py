"""sim (see README.md)."""
