"""What the lab's rooms share: an in-process model, store and template (``in_process``), the benchmarks' baselines
composed from the serving classes (``baselines``), how close a cached edit is to the full one (``edit_quality``), and
the local cluster — N Triton instances behind the router (``cluster``), restarted when they die (``supervisor``)."""
