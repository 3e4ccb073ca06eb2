"""The embedded tiny models (``deepinfer/assets/``): their story corpus, the dense training references of V4.1 and
its DSpark drafter, and the training scripts."""
