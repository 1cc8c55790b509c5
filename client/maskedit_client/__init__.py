"""Client for the maskedit Triton service: ``EditClient(url).edit(template, mask, prompt) -> EditResult``."""

from .client import EditClient, EditError, EditResult, encode_image

__all__ = ["EditClient", "EditError", "EditResult", "encode_image"]
