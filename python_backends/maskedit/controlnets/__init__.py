"""ControlNets: the library of ControlNets requests name (``library``), what a request's controls are on their way
through the stages (``job``), the server-side preprocessors (``preprocessors``) and the Flux ControlNets' shared
pieces (``flux``: fit, union modes, batched residuals; used by the Flux families). The per-step computation is the
model family's (``ModelFamily.control_residuals``, called from its ``step``); docs/controlnet.md."""
