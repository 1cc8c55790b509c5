"""The add-ons against the base edit and stock Diffusers: LoRA adapters (``bench_addons`` with ``lora_cases``,
``timing``, ``results``, ``report``, ``flux_width_blocks``; ``lora_load``, ``lora_early_start``,
``lora_base_reuse``) and ControlNets (``bench_controlnet``, ``bench_controlnet_flux``, ``bench_controlnet_mask``,
``bench_controlnet_placement``, ``sdxl_controlnet``, the shared ``side_by_side`` loop)."""
