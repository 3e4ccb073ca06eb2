"""Example third-party DeepInfer backend (see README.md)."""
