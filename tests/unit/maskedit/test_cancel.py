"""Cancel markers: swept on their own."""

import os
import time


def test_cancel_markers_are_swept_without_a_cancel_call(tmp_path):
    """Markers of requests that never reached a denoise loop go away on their own, not at the next cancel call."""
    from maskedit.cancel import CancelBoard

    board = CancelBoard(tmp_path)
    board.cancel("gone-1")
    old = time.time() - 10
    os.utime(tmp_path / "gone-1", (old, old))
    board.cancel("fresh-1")
    stop = board.sweep_every(interval_s=0.05, max_age_s=5)
    try:
        deadline = time.monotonic() + 5
        while (tmp_path / "gone-1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (tmp_path / "gone-1").exists() and (tmp_path / "fresh-1").exists()
    finally:
        stop.set()
