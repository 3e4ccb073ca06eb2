"""Model state memory shared by the V4 family: buffer specs, sizing, the pool, and per-step index plans."""
