"""Blocks more than one model of the V4 family uses (mHC sites, MoE, compressor windows, RoPE tables)."""
