"""The ControlNet methods both Flux families share (``flux_controlnet``, and ``flux_fill``'s ControlNet extension:
docs/controlnet_flux.md): FLUX.1 ControlNets (``FluxControlNetModel``, plain or union), computed by
``maskedit.controlnets.flux`` in-process and by ``controlnets.flux_remote`` in the ``controlnet`` Triton model.
Mixed in before ``ModelFamily``, whose defaults these replace."""

from __future__ import annotations

from typing import ClassVar


class FluxControls:
    controlnet_classes: ClassVar[tuple[str, ...]] = ("FluxControlNetModel",)

    def controlnet_union(self, config: dict) -> bool:
        from ..controlnets.flux import is_union

        return is_union(config)

    def control_mode_index(self, mode: str, config: dict) -> int:
        from ..controlnets.flux import mode_index

        return mode_index(mode, config)

    def remote_residuals(self, actives: list, inputs: dict) -> tuple[list, list[int]]:
        """Placement ``triton``: the ``controlnet`` model's merged double / single samples for one request."""
        from ..controlnets.flux_remote import remote_residuals

        return remote_residuals(self, actives, inputs)
