"""maskedit: mask-aware generative image editing served on Triton.

Plain Python packages hold the logic; the Triton ``model.py`` files in
``model_repository/`` are thin shims that call into them.
"""

__version__ = "0.1.0"
