"""Load generator for the maskedit service: open-loop Poisson arrivals or trace replay, synthetic masks whose
ratios follow InstGenIE's reported workloads, Zipf-popular templates; records per request; JSON/CSV and plots.
It only makes and sends load: what starts a cluster or judges a run (``make chaos``, ``overload``, ``soak``, ...) is
the lab's (``maskedit_lab.reliability``), which drives it; it imports nothing of the lab (``.importlinter``)."""
