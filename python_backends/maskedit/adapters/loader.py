"""Background threads that load requests' adapters (``AdapterRuntime.resolve``: host read or library conversion),
so the denoise loop never waits on a file, a conversion or a copy. Daemon threads started on first use: a load in
progress never holds a process at exit."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class AdapterLoader:
    def __init__(self, resolve: Callable, threads: int = 1):
        self.resolve = resolve
        self.threads = max(1, int(threads))
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._mu = threading.Lock()

    def submit(self, refs) -> Future:
        """A future of ``resolve(refs)``: its result, or the error that refused an adapter (``InvalidInput``)."""
        f: Future = Future()
        self._q.put((f, refs))
        with self._mu:
            if len(self._workers) < self.threads:
                t = threading.Thread(target=self._run, name=f"lora-load-{len(self._workers)}", daemon=True)
                self._workers.append(t)
                t.start()
        return f

    def _run(self) -> None:
        while True:
            f, refs = self._q.get()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(self.resolve(refs))
            except BaseException as e:  # noqa: BLE001 - the request's error, raised where it is collected
                f.set_exception(e)
