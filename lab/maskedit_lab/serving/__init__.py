"""The served system under load: real tritonservers against stock Diffusers served as a thin Triton model
(``bench_serving`` over ``stock``), and the batching schemes side by side (``bench_batching``)."""
