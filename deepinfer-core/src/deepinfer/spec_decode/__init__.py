"""Speculative decoding: the drafter protocol, the verifier (acceptance) and the verify budget (plain data)."""

from deepinfer.spec_decode.drafter import Drafter, DraftingModel, DraftRequest, Drafts, GraphDrafter, VerifyExtender

__all__ = ["DraftRequest", "Drafter", "DraftingModel", "Drafts", "GraphDrafter", "VerifyExtender"]
