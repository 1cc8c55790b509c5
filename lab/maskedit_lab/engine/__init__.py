"""What measures the engine in one process: the mask-aware cache against full computation (``bench_engine``), the
cost-model calibration (``calibrate``), temporal reuse (``bench_temporal``), STRENGTH and the cache
(``strength_cache``), what stock kernels allow (``kernel_ceiling``, ``unet_costs``), a rerun against the committed
figures (``engine_drift``) and the Qwen prompt encoder's cost (``qwen_encoder_cost``)."""
