"""Adapters between Triton's Python backend (``triton_python_backend_utils``) and the maskedit stages.

Only these modules import ``triton_python_backend_utils``, which exists only inside a Triton stub
process; the ``model.py`` files in ``model_repository/`` re-export the classes defined here.
"""
