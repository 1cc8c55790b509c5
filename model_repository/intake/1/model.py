"""Triton shim for `intake`: the logic lives in maskedit.intake.

The backend stub's embedded interpreter ignores PYTHONPATH, so the launcher passes the project's import
paths in MASKEDIT_PYTHONPATH and they are put first on sys.path here.
"""
import os
import sys

sys.path[:0] = [p for p in os.environ.get("MASKEDIT_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

from maskedit.triton.intake_model import TritonPythonModel  # noqa: E402,F401
