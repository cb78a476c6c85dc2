"""Runnable adaptation-policy examples (KungFu-style) on scikit-learn's digits."""
