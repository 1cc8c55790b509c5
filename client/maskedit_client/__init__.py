"""Client for the maskedit Triton service: ``EditClient(url).edit(template, mask, prompt) -> EditResult``."""

from .client import EditClient
from .inputs import encode_image
from .results import EditError, EditResult

__all__ = ["EditClient", "EditError", "EditResult", "encode_image"]
