"""FLUX.2 [klein] inpainting (``Flux2KleinInpaintPipeline``) as a model family. Docstring: see below."""

from .family import Flux2KleinFamily, KleinTensors

__all__ = ["Flux2KleinFamily", "KleinTensors"]
