"""Accuracy measurements whose numbers go into the docs."""
