"""Load generator for the maskedit service: open-loop Poisson arrivals or trace replay, synthetic masks whose
ratios follow InstGenIE's reported workloads, Zipf-popular templates; records per request; JSON/CSV and plots."""
