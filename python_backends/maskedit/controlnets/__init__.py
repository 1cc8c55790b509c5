"""ControlNets: the library of ControlNets requests name (``library``), what a request's controls are on their way
through the stages (``job``) and the server-side preprocessors (``preprocessors``). The per-step computation is the
model family's (``ModelFamily.control_residuals``, called from its ``step``); docs/controlnet.md."""
