"""Nothing of a local run is left outside the checkout: its host-memory directories live in one directory removed when
the run stops (``maskedit.scratch``), the Triton backend stubs in the checkout's build/ (never a /tmp copy shared by
every checkout on the host), and ``make serve`` runs its server without a sub-make (which, on Ctrl-C, reported
``make[1]: *** wait: No child processes``)."""

import os
import re

from maskedit.launcher import TritonServer, backend_dir
from maskedit.scratch import RUN_VARS, run_scratch
from maskedit.settings import REPO_ROOT, load_settings


def test_a_run_puts_its_directories_in_one_place_and_removes_it(monkeypatch):
    for var in RUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASKEDIT_CANCEL_DIR", "/somewhere/the/user/chose")
    with run_scratch() as d:
        s = load_settings()
        assert {s.cache.mem_dir.parent, s.service.admission_dir.parent, s.lora_host_cache_dir.parent} == {d}
        assert str(s.service.cancel_dir) == "/somewhere/the/user/chose"  # set by the caller: kept
        (s.cache.mem_dir / "entry").mkdir(parents=True)
    assert not d.exists()
    assert "MASKEDIT_CACHE_MEM_DIR" not in os.environ and os.environ["MASKEDIT_CANCEL_DIR"].startswith("/somewhere")


def test_backend_stubs_and_default_logs_stay_in_the_checkout():
    d = backend_dir()
    assert d.parent == REPO_ROOT / "build" and (d / "python" / "triton_python_backend_stub").is_file()
    assert not list((d / "python").glob(".*.partial"))
    assert REPO_ROOT in TritonServer().log_path.parents


def test_make_serve_runs_its_server_without_a_sub_make():
    make = (REPO_ROOT / "Makefile").read_text()
    for target in ("serve", "serve-cluster"):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", make, re.M).group(1)
        assert "$(MAKE)" not in recipe and "exec " in recipe, recipe
