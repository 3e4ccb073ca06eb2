"""Speculative decoding: the drafter protocol, the verifier (acceptance) and the verify budget (plain data)."""

from deepinfer.spec_decode.drafter import Drafter, DraftRequest, Drafts, GraphDrafter

__all__ = ["DraftRequest", "Drafter", "Drafts", "GraphDrafter"]
