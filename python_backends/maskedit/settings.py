"""The backend's settings: the one ``Settings`` object, defined (with every ``MASKEDIT_*`` variable it reads) in
``maskedit_common.settings`` and shared with the router, re-exported here for the serving modules; and
``REPO_ROOT``, the source tree the launcher serves from (``model_repository/`` and the packages the Triton stubs
import). Cost profiles are not found through ``REPO_ROOT``: see ``Settings.profiles``.
"""

from __future__ import annotations

from pathlib import Path

from maskedit_common.settings import SERVING_DEFAULTS_FILE, Settings, load_settings

__all__ = ["REPO_ROOT", "SERVING_DEFAULTS_FILE", "Settings", "load_settings"]

REPO_ROOT = Path(__file__).resolve().parents[2]
