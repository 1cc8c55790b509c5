"""Start and stop a local ``tritonserver`` built from the ``nvidia-pytriton`` wheel.

The wheel ships the server binary, the Python backend and one backend stub per Python version; this
module copies backend + stub into one backend directory, puts the wheel's shared libraries on
``LD_LIBRARY_PATH`` and the project's import paths in ``MASKEDIT_PYTHONPATH`` (the stub's embedded
interpreter ignores PYTHONPATH; the model.py shims read it), starts the server in its own process
group, waits until every model is ready, and stops it by pid: SIGTERM, a timeout, then SIGKILL of the
whole group (stubs included).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from maskedit_common import backend_guard
from maskedit_common.tenant_wire import TRITON_ARGS

from . import admission
from .repository import REPOSITORY
from .scratch import run_scratch
from .settings import REPO_ROOT, Settings, load_settings

log = logging.getLogger(__name__)
MODELS = ("intake", "preprocess", "masked_denoise", "vae_decode", "cancel", "edit")
# A start takes minutes on a 2-core host beside other CPU-bound work; a server that exits is seen at once (its exit
# status), so only a hung start waits this long.
START_TIMEOUT_S = 600.0
# How long a stopping server waits for its models to unload (then exits without cleaning up): a few seconds on a
# quiet host, more than 10 for three stubs beside other CPU-bound work.
EXIT_TIMEOUT_S = 20
# The Python backend makes one (empty, for models without EXECUTION_ENV_PATH) directory here per server and removes
# it on a clean exit only.
PYTHON_ENV_DIRS = Path("/tmp/python_env_*")


def pytriton_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent


def backend_dir(dest: Path | None = None) -> Path:
    """A backend directory holding the Python backend and the stub for this interpreter's version: inside this
    checkout (``build/``), so checkouts of different versions on one host never share a copy, and nothing is left
    in /tmp."""
    src = pytriton_root() / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    py = Path(dest or REPO_ROOT / "build" / f"backends-{ver}") / "python"
    for name, source in (("libtriton_python.so", src / "backends" / "python" / "libtriton_python.so"),
                         ("triton_python_backend_utils.py", src / "backends" / "python" / "triton_python_backend_utils.py"),
                         ("triton_python_backend_stub", src / "python_backend_stubs" / ver / "triton_python_backend_stub")):
        if not (py / name).exists():
            py.mkdir(parents=True, exist_ok=True)
            tmp = py / f".{name}.{os.getpid()}.partial"  # renamed into place: a server starting beside this one
            shutil.copy2(source, tmp)                     # never loads a half-copied file
            tmp.rename(py / name)
    return py.parent


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    libs = pytriton_root().parent / "nvidia_pytriton.libs"
    # The stub embeds this interpreter: it needs libpython (LIBDIR) besides the wheel's own libraries.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), sysconfig.get_config_var("LIBDIR") or "",
                                                         env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub ignores PYTHONPATH: the shims put these first on sys.path (this environment's PYTHONPATH included,
    # e.g. packages unpacked beside a system Python on a machine without a package index).
    paths = [str(REPO_ROOT / "python_backends"), str(REPO_ROOT / "common"), str(REPO_ROOT / "client"),
             *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p], sysconfig.get_paths()["purelib"]]
    env["MASKEDIT_PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    # importing diffusers makes torch's inductor cache directory, /tmp/torchinductor_$USER unless told: in build/
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / "build" / "torchinductor"))
    env.update(extra or {})
    return env


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all held open while they are picked (one at a time, the kernel may hand the port
    it just took back again; a server then found its HTTP and gRPC ports equal and would not start)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class TritonServer:
    """One local tritonserver. Use as a context manager, or call ``start()`` / ``stop()``."""

    def __init__(self, repository: Path = REPOSITORY, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, env: dict | None = None, log_path: Path | None = None,
                 extra_args: list[str] | None = None):
        self.repository = Path(repository)
        picked = iter(free_ports(3))
        self.http_port, self.grpc_port, self.metrics_port = (p or next(picked) for p in
                                                             (http_port, grpc_port, metrics_port))
        self.env = env or {}
        # default: in the checkout's out/ (written from ``start``), never /tmp
        self.log_path = Path(log_path or REPO_ROOT / "out" / "logs" / f"tritonserver-{self.http_port}.log")
        self.extra_args = extra_args or []
        # The Python backend's shared-memory regions are named after this prefix, so a server that had to be
        # killed (its stubs cannot unlink them then) can have them removed by ``stop``.
        self.shm_prefix = f"maskedit_tpb_{uuid.uuid4().hex[:12]}"
        self.proc: subprocess.Popen | None = None
        self.python_env_dir: Path | None = None

    @property
    def settings(self) -> Settings:
        """The settings this server's model processes read (this environment with the server's ``env`` over it)."""
        return load_settings({**os.environ, **self.env})

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def backend_key(self) -> str | None:
        """The shared secret every call but health must carry (``MASKEDIT_BACKEND_KEY_FILE``), or None: open."""
        path = self.settings.security.backend_key_file
        return backend_guard.read(path) if path else None

    def command(self) -> list[str]:
        key = self.backend_key
        return [
            str(pytriton_root() / "tritonserver" / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir()}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--strict-readiness=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            # every config.pbtxt is complete: without this the Python backend starts one more stub per model, just to
            # ask it for a config, importing torch and the pipeline twice (a model's load and reload took 2x as long)
            "--disable-auto-complete-config",
            "--backend-config=python,shm-default-byte-size=16777216",
            "--backend-config=python,shm-growth-byte-size=16777216",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--log-verbose=0",
            *TRITON_ARGS,  # the endpoint picker's tenant headers reach fair share as request parameters
            *(backend_guard.triton_args(key) if key else ()),  # only callers with the key (the router, the picker)
            *self.extra_args,
        ]

    def start(self, timeout: float = START_TIMEOUT_S) -> "TritonServer":
        if self.proc is not None and self.proc.poll() is None:
            return self  # already running (``with TritonServer(...).start()`` must not start a second, orphaned one)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.shm_prefix = f"maskedit_tpb_{uuid.uuid4().hex[:12]}"  # per start: a restart's regions are told apart
        logf = open(self.log_path, "ab")
        envs = set(PYTHON_ENV_DIRS.parent.glob(PYTHON_ENV_DIRS.name))
        self.proc = subprocess.Popen(self.command(), env=server_env(self.env), stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        # Its Python backend's directory, if it is the only one made meanwhile (other servers may start beside it)
        new = set(PYTHON_ENV_DIRS.parent.glob(PYTHON_ENV_DIRS.name)) - envs
        self.python_env_dir = new.pop() if len(new) == 1 else None
        log.info("tritonserver pid %s ready: grpc %s http %s", self.proc.pid, self.grpc_url, self.http_url)
        return self

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            if self._get("/v2/health/ready") == 200 and all(
                    self._get(f"/v2/models/{m}/ready") == 200 for m in self.models()):
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout}s; log:\n{self.log_tail()}")

    def models(self) -> list[str]:
        """Every model of the repository (the service's, or another repository's, e.g. a benchmark baseline)."""
        return sorted(p.name for p in self.repository.iterdir() if (p / "config.pbtxt").exists())

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = EXIT_TIMEOUT_S + 10) -> None:
        """SIGTERM the server, wait, then SIGKILL whatever is left of its process group (stubs included). The server
        alone is signalled first: it unloads its models, which stops their stubs in order and removes the Python
        backend's /tmp/python_env_* directory; stubs signalled beside it die under it, and the server then waits
        out its exit timeout and exits without cleaning up."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the server's pid
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("tritonserver pid %s did not exit in %ss; killing", pgid, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):  # left behind by a killed server
            with contextlib.suppress(OSError):
                region.unlink()
        if self.python_env_dir is not None:  # left behind by a server that had to exit without cleaning up
            with contextlib.suppress(OSError):
                self.python_env_dir.rmdir()  # only if empty: it holds nothing unless EXECUTION_ENV_PATH is used
            self.python_env_dir = None
        admission.remove(self.settings.service.admission_dir, pgid)  # its denoise queue board
        self.proc = None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Serve model_repository/ with a local tritonserver until Ctrl-C.")
    ap.add_argument("--repository", type=Path, default=REPOSITORY)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--log", type=Path, default=REPO_ROOT / "out" / "tritonserver.log")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, _interrupt)  # while starting, SIGTERM ends the start as Ctrl-C does
    with run_scratch():  # the run's host-memory directories, removed on the way out
        server = TritonServer(args.repository, args.http_port, args.grpc_port, args.metrics_port, log_path=args.log)
        try:
            server.start()  # interrupted: it stops what it started
        except KeyboardInterrupt:
            print("stopped before the server was ready", flush=True)
            return
        for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C reaches make and this process: stop, quietly
            signal.signal(sig, lambda *_: stop.set())
        print(f"serving {args.repository}: gRPC {server.grpc_url}, HTTP {server.http_url}, "
              f"metrics 127.0.0.1:{server.metrics_port} (log {args.log}); Ctrl-C to stop", flush=True)
        print("backend key on: every call but health needs the key's header (docs/security.md)" if server.backend_key
              else "no backend key: any caller that reaches these ports is served (set MASKEDIT_BACKEND_KEY_FILE)",
              flush=True)
        if server.settings.security.api_keys_file:
            print("warning: MASKEDIT_API_KEYS_FILE is set, but a lone tritonserver checks no API keys: serve through "
                  "the router (`make serve` does when it is set)", flush=True)
        try:
            while not stop.is_set() and server.proc.poll() is None:
                stop.wait(0.5)
        finally:
            server.stop()
    print("server stopped", flush=True)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
