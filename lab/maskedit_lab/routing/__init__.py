"""The router beyond this machine: the routing policies on the production trace over simulated workers (``sim``,
``sim_cluster``), the simulator checked against real instances (``validate``, ``validate_replay``), and the real
router process in front of many emulated Triton instances (``scale``, ``triton_emulator``). All of them place with
the router's own code (``maskedit_router.placement``)."""
