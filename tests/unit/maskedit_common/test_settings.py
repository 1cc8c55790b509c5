"""One settings object reads every ``MASKEDIT_*`` variable; the documented table is the code's; nothing else reads
one; cost profiles are found through the settings."""

import json
import re
from pathlib import Path

import pytest

from maskedit_common import settings as S
from maskedit_common.settings import Settings, load_settings
from tests.conftest import REPO_ROOT

# Every variable set to a value other than its default, and the field that must then hold it.
NON_DEFAULT = {
    "MASKEDIT_DEVICE": ("cpu", "device", "cpu"),
    "MASKEDIT_DTYPE": ("bfloat16", "dtype", "bfloat16"),
    "MASKEDIT_RESOLUTION": ("512", "resolution", 512),
    "MASKEDIT_STEPS": ("6", "steps", 6),
    "MASKEDIT_GUIDANCE": ("3.5", "guidance", 3.5),
    "MASKEDIT_MAX_SEQUENCE_LENGTH": ("77", "max_sequence_length", 77),
    "MASKEDIT_MODEL_VERSION": ("v2", "model_version", "v2"),
    "MASKEDIT_COST_PROFILE": ("/p/profile.json", "cost_profile", Path("/p/profile.json")),
    "MASKEDIT_PROFILES_DIR": ("/p", "profiles_dir", Path("/p")),
    "MASKEDIT_MAX_STEPS": ("20", "max_steps", 20),
    "MASKEDIT_LORA_DIR": ("/l", "lora_dir", Path("/l")),
    "MASKEDIT_LORA_HOST_DIR": ("/h", "lora_host_dir", Path("/h")),
    "MASKEDIT_LORA_HOST_BYTES": ("1e6", "lora_host_bytes", 1000000),
    "MASKEDIT_LORA_DEVICE_BYTES": ("2048", "lora_device_bytes", 2048),
    "MASKEDIT_LORA_LOAD_THREADS": ("3", "lora_load_threads", 3),
    "MASKEDIT_LORA_EARLY_START": ("1", "lora_early_start", True),
    "MASKEDIT_LORA_MERGE": ("never", "lora_merge", "never"),
    "MASKEDIT_PROMPT_CACHE_BYTES": ("1e8", "prompt_cache_bytes", 100000000),
    "MASKEDIT_LORA_MERGE_BYTES": ("2e9", "lora_merge_bytes", 2000000000),
    "MASKEDIT_LORA_ROOTS": ("/in:/up", "lora_roots", (Path("/in"), Path("/up"))),
    "MASKEDIT_MAX_LORAS": ("2", "max_loras", 2),
    "MASKEDIT_MAX_LORA_SCALE": ("1.5", "max_lora_scale", 1.5),
    "MASKEDIT_CONTROLNET_DIR": ("/c", "controlnet_dir", Path("/c")),
    "MASKEDIT_MAX_CONTROLS": ("3", "max_controls", 3),
    "MASKEDIT_MAX_REFERENCE_IMAGES": ("2", "max_reference_images", 2),
    "MASKEDIT_CONTROLNET_PLACEMENT": ("triton", "controlnet_placement", "triton"),
    "MASKEDIT_CONTROLNET_TIMEOUT_S": ("2.5", "controlnet_timeout_s", 2.5),
    "MASKEDIT_TEMPORAL": ('{"policy": "fbcache", "threshold": 0.1}', "temporal",
                          '{"policy": "fbcache", "threshold": 0.1}'),
    "MASKEDIT_MAX_CONTROL_SCALE": ("1.5", "max_control_scale", 1.5),
    "MASKEDIT_MAX_GUIDANCE": ("10", "max_guidance", 10.0),
    "MASKEDIT_MAX_PROMPT_CHARS": ("99", "max_prompt_chars", 99),
    "MASKEDIT_MAX_INPUT_PIXELS": ("1000000", "max_input_pixels", 1000000),
    "MASKEDIT_FEATHER_PX": ("0", "feather_px", 0),
    "MASKEDIT_MASK_THRESHOLD": ("1", "mask_threshold", 1),
    "MASKEDIT_CACHE": ("off", "cache.policy", "off"),
    "MASKEDIT_CACHE_MEM_DIR": ("/m", "cache.mem_dir", Path("/m")),
    "MASKEDIT_CACHE_MEM_BYTES": ("1e6", "cache.mem_bytes", 1000000),
    "MASKEDIT_CACHE_DISK_DIR": ("/d", "cache.disk_dir", Path("/d")),
    "MASKEDIT_CACHE_DISK_BYTES": ("2048", "cache.disk_bytes", 2048),
    "MASKEDIT_CACHE_DISK_FREE_FRACTION": ("0.25", "cache.disk_free_fraction", 0.25),
    "MASKEDIT_CACHE_BUDGET_BYTES": ("4096", "cache.budget_bytes", 4096),
    "MASKEDIT_CACHE_LORA_BASE_REUSE": ("1", "cache.lora_base_reuse", True),
    "MASKEDIT_BATCHING": ("priority", "batching.policy", "priority"),
    "MASKEDIT_MAX_BATCH": ("2", "batching.max_batch", 2),
    "MASKEDIT_MAX_TOKENS_PER_STEP": ("500", "batching.max_tokens_per_step", 500),
    "MASKEDIT_MAX_QUEUE": ("8", "batching.max_queue", 8),
    "MASKEDIT_REJECT_LATE": ("0", "batching.reject_late", False),
    "MASKEDIT_LATENCY_BOUND_S": ("10", "batching.latency_bound_s", 10.0),
    "MASKEDIT_CLOCK_SKEW_S": ("0.5", "batching.clock_skew_s", 0.5),
    "MASKEDIT_MAX_WAIT_STEPS": ("3", "batching.max_wait_steps", 3),
    "MASKEDIT_FAIR_SHARE": ("0", "batching.fair_share", False),
    "MASKEDIT_LOG_LEVEL": ("DEBUG", "service.log_level", "DEBUG"),
    "MASKEDIT_THREADS_<MODEL>": (None, "service.threads", None),  # a family: checked below
    "MASKEDIT_SHUTDOWN_GRACE_S": ("2.5", "service.shutdown_grace_s", 2.5),
    "MASKEDIT_CANCEL_DIR": ("/c", "service.cancel_dir", Path("/c")),
    "MASKEDIT_CANCEL_SWEEP_S": ("7", "service.cancel_sweep_s", 7.0),
    "MASKEDIT_ADMISSION_DIR": ("/a", "service.admission_dir", Path("/a")),
    "MASKEDIT_METRICS_SYNC_S": ("1", "service.metrics_sync_s", 1.0),
    "MASKEDIT_CACHE_PROBE_S": ("0.5", "cache.probe_s", 0.5),
    "MASKEDIT_API_KEYS_FILE": ("/k/keys.txt", "security.api_keys_file", Path("/k/keys.txt")),
    "MASKEDIT_TLS_CERT": ("/k/tls.crt", "security.tls_cert", Path("/k/tls.crt")),
    "MASKEDIT_TLS_KEY": ("/k/tls.key", "security.tls_key", Path("/k/tls.key")),
    "MASKEDIT_BACKEND_KEY_FILE": ("/k/backend.key", "security.backend_key_file", Path("/k/backend.key")),
}


def _get(s: Settings, target: str):
    section, _, name = target.rpartition(".")
    return getattr(getattr(s, section) if section else s, name)


def test_every_variable_sets_its_field(tmp_path):
    settable = {v.name: v for v in S.VARIABLES if v.target and v.target != "model_dir"}
    assert set(settable) == set(NON_DEFAULT)
    default = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path)})
    for name, (text, target, want) in NON_DEFAULT.items():
        assert settable[name].target == target
        if text is None:
            continue
        s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path), name: text})
        assert _get(s, target) == want != _get(default, target), name
    s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path), "MASKEDIT_THREADS_MASKED_DENOISE": "3",
                       "MASKEDIT_THREADS_PREPROCESS": "1"})
    assert s.service.threads_for("masked_denoise") == 3 and s.service.threads_for("PREPROCESS") == 1
    assert s.service.threads_for("vae_decode") is None and default.service.threads == ()


def test_defaults_without_variables_are_the_dataclasses(tmp_path):
    assert load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path)}) == Settings(model_dir=tmp_path)
    assert load_settings({}).model_dir == S.default_model_dir()
    if S.CHECKOUT is not None:  # this checkout's models/ (what `make model` builds)
        assert S.default_model_dir() == REPO_ROOT / "models" / "tiny-flux-fill"


def test_model_directory_defaults_and_the_environment_over_them(tmp_path):
    (tmp_path / S.SERVING_DEFAULTS_FILE).write_text(json.dumps({"resolution": 256, "steps": 8, "preset": "tiny",
                                                                "model_dir": "/elsewhere"}))
    s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path)})
    assert (s.resolution, s.steps, s.model_dir) == (256, 8, tmp_path)
    assert load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path), "MASKEDIT_STEPS": "3"}).steps == 3


def test_unknown_policies_are_refused_when_read():
    with pytest.raises(ValueError, match="MASKEDIT_CACHE='all_y'"):
        load_settings({"MASKEDIT_CACHE": "all_y"})  # a lab baseline, not a serving policy
    with pytest.raises(ValueError, match="MASKEDIT_BATCHING"):
        load_settings({"MASKEDIT_BATCHING": "fifo"})
    with pytest.raises(ValueError, match="MASKEDIT_LORA_MERGE='sometimes'"):
        load_settings({"MASKEDIT_LORA_MERGE": "sometimes"})


def test_policy_choices_are_the_serving_components():
    from maskedit.adapters.merge import MODES
    from maskedit.cache.policy import POLICIES
    from maskedit.cache.store import DISK_FREE_FRACTION
    from maskedit.scheduler import BatchScheduler

    assert S.CACHE_POLICIES == POLICIES
    assert S.BATCHING_POLICIES == BatchScheduler.POLICIES
    assert S.LORA_MERGE_MODES == MODES
    assert S.CacheSettings().disk_free_fraction == DISK_FREE_FRACTION


def test_profiles_are_found_through_the_settings(tmp_path):
    s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path / "flux"), "MASKEDIT_PROFILES_DIR": str(tmp_path / "p")})
    assert s.cost_profile_for("cpu") == tmp_path / "p" / "cost_model_flux.json"
    assert s.cost_profile_for("h100") == tmp_path / "p" / "cost_model_flux_h100.json"
    assert s.profile_path("cpu", "bench-flux-fill") == tmp_path / "p" / "cost_model_bench-flux-fill.json"
    pinned = load_settings({"MASKEDIT_COST_PROFILE": str(tmp_path / "x.json")})
    assert pinned.cost_profile_for("h100") == tmp_path / "x.json"
    plain = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path / "flux")})
    if S.CHECKOUT is not None:  # a source checkout serves the repository's profiles
        assert plain.profiles == REPO_ROOT / "perf_profiles"
    else:  # an installed package: profiles beside the weights
        assert plain.profiles == tmp_path / "flux"


def test_installed_package_finds_profiles_in_the_model_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "CHECKOUT", None)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path / "flux")})
    assert s.profiles == tmp_path / "flux" and s.cost_profile_for("cpu") == tmp_path / "flux" / "cost_model_flux.json"
    assert S.default_model_dir() == Path.home() / ".cache" / "maskedit" / "models" / "tiny-flux-fill"


def test_the_documented_table_is_the_codes():
    doc = (REPO_ROOT / "docs" / "settings.md").read_text()
    assert S.with_table(doc) == doc, "regenerate: python -m maskedit_common.settings --write docs/settings.md"
    assert "docs/settings.md" in (REPO_ROOT / "README.md").read_text()


SOURCES = ["common", "python_backends", "router", "client", "lab", "loadgen", "model_repository"]
NAME = re.compile(r"MASKEDIT_[A-Z0-9_]*[A-Z0-9]")
# A read of a variable: os.environ[...] / .get(...) / getenv(...) of a MASKEDIT_* literal (an assignment is a write).
READ = re.compile(r"""(?:\.get\(|getenv\(|environ\[|env\[)\s*f?["'](MASKEDIT_[A-Z0-9_]*)["']?(?![^\n]*\]\s*=[^=])""")


def _files():
    for top in SOURCES:
        yield from (p for p in (REPO_ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_variable_in_the_code_is_documented():
    known = {v.name for v in S.VARIABLES}
    texts = [p.read_text() for p in _files()]
    texts += [(REPO_ROOT / f).read_text() for f in ("Dockerfile", "Makefile", "README.md")]
    texts += [p.read_text() for p in (REPO_ROOT / "deploy").rglob("*.yaml")]
    texts += [p.read_text() for p in (REPO_ROOT / "docs").glob("*.md")]
    found = {m for t in texts for m in NAME.findall(t)}
    undocumented = {n for n in found if n not in known and not n.startswith("MASKEDIT_THREADS")}
    assert not undocumented


def test_only_the_settings_module_reads_variables():
    """Every other module is handed its settings; the Triton shims (and the lab's shim, and the launcher's own
    product) may read ``MASKEDIT_PYTHONPATH``, which must be read before anything can be imported."""
    offenders = []
    for p in _files():
        if p == REPO_ROOT / "common" / "maskedit_common" / "settings.py":
            continue
        for line in p.read_text().splitlines():
            offenders += [f"{p.relative_to(REPO_ROOT)}: {line.strip()}" for name in READ.findall(line)
                          if name != "MASKEDIT_PYTHONPATH"]
    assert not offenders
