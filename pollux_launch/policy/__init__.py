"""policy (see README.md)."""
