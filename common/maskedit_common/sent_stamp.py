"""When a request was sent, as its sender stamps it: the request parameters a backend's bound counts from
(``maskedit.arrival`` reads them).

Triton tells a Python model nothing of when a request arrived, and a request can wait seconds in Triton's queue in
front of pre-processing. So whoever sends a request to a backend stamps it: our client as it sends it
(``maskedit_client``, which spells these names itself: it imports nothing of the server side; a test holds the two
to each other), the router as it receives it (``maskedit_router.proxy``, overwriting the client's: the bound counts
from the service's front door, on the router's clock).

- ``SENT_AT``: the sender's ``time.time()`` when it sent (or received) the request (a double; a number in text is
  taken too, as a header or a JSON body carries it).
- ``SENT_CLOCK``: which clock that is: the sender host's boot id (``/proc/sys/kernel/random/boot_id``, the same in
  every container of one kernel). A backend whose boot id it is reads the stamp on its own clock, exactly; another
  host's stamp is believed within the clocks' tolerance (``MASKEDIT_CLOCK_SKEW_S``).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

SENT_AT = "maskedit_sent_at"
SENT_CLOCK = "maskedit_sent_clock"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache  # one boot id for the process's life
def host_clock() -> str:
    """This host's clock identity: its kernel's boot id ("" where there is none: another OS, never matched)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def stamp(now: float | None = None, clock: str | None = None) -> dict:
    """The parameters stamping a request sent (or received) ``now`` (default: this moment) on this host."""
    return {SENT_AT: time.time() if now is None else now, SENT_CLOCK: host_clock() if clock is None else clock}
