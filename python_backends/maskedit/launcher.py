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
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from maskedit_common.tenant_wire import TRITON_ARGS

from . import admission
from .repository import REPOSITORY
from .settings import REPO_ROOT, Settings, load_settings

log = logging.getLogger(__name__)
MODELS = ("preprocess", "masked_denoise", "vae_decode", "cancel", "edit")


def pytriton_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent


def backend_dir(dest: Path | None = None) -> Path:
    """A backend directory holding the Python backend and the stub for this interpreter's version."""
    src = pytriton_root() / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest = Path(dest or Path(tempfile.gettempdir()) / f"maskedit-backends-{ver}")
    py = dest / "python"
    stub = py / "triton_python_backend_stub"
    if not stub.exists():
        py.mkdir(parents=True, exist_ok=True)
        for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(src / "backends" / "python" / f, py / f)
        tmp = py / ".stub.partial"
        shutil.copy2(src / "python_backend_stubs" / ver / "triton_python_backend_stub", tmp)
        tmp.chmod(0o755)
        tmp.rename(stub)
    return dest


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
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.extra_args = extra_args or []
        # The Python backend's shared-memory regions are named after this prefix, so a server that had to be
        # killed (its stubs cannot unlink them then) can have them removed by ``stop``.
        self.shm_prefix = f"maskedit_tpb_{uuid.uuid4().hex[:12]}"
        self.proc: subprocess.Popen | None = None

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

    def command(self) -> list[str]:
        return [
            str(pytriton_root() / "tritonserver" / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir()}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--strict-readiness=true",
            "--exit-timeout-secs=10",
            # every config.pbtxt is complete: without this the Python backend starts one more stub per model, just to
            # ask it for a config, importing torch and the pipeline twice (a model's load and reload took 2x as long)
            "--disable-auto-complete-config",
            "--backend-config=python,shm-default-byte-size=16777216",
            "--backend-config=python,shm-growth-byte-size=16777216",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--log-verbose=0",
            *TRITON_ARGS,  # the endpoint picker's tenant headers reach fair share as request parameters
            *self.extra_args,
        ]

    def start(self, timeout: float = 300.0) -> "TritonServer":
        if self.proc is not None and self.proc.poll() is None:
            return self  # already running (``with TritonServer(...).start()`` must not start a second, orphaned one)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.shm_prefix = f"maskedit_tpb_{uuid.uuid4().hex[:12]}"  # per start: a restart's regions are told apart
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=server_env(self.env), stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
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

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, wait, then SIGKILL whatever is left (stubs included)."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the server's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
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
    server = TritonServer(args.repository, args.http_port, args.grpc_port, args.metrics_port, log_path=args.log)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    server.start()
    print(f"serving {args.repository}: gRPC {server.grpc_url}, HTTP {server.http_url}, "
          f"metrics 127.0.0.1:{server.metrics_port} (log {args.log}); Ctrl-C to stop", flush=True)
    try:
        while not stop["now"] and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
