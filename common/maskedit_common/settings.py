"""Every ``MASKEDIT_*`` setting, read in one place.

``load_settings()`` reads the environment (and the model directory's ``maskedit.json``: the model's own defaults)
into one frozen ``Settings``: the model and the limits every request is checked against (flat: every stage reads
them), and the sections the serving parts are handed: ``cache`` (the activation cache and its store),
``batching`` (the denoise loop's scheduler and queue) and ``service`` (the processes: logs, threads, shared-memory
directories, timers). Nothing else reads a ``MASKEDIT_*`` variable (the Triton model shims read
``MASKEDIT_PYTHONPATH`` before anything can be imported; a unit test checks both). ``VARIABLES`` names every
variable, the field it sets and what it means: docs/settings.md's table is generated from it
(``python -m maskedit_common.settings --write docs/settings.md``) and a unit test keeps the two equal.

Cost profiles are found through the settings, never through where this code lies: ``MASKEDIT_COST_PROFILE`` (a
file), else ``cost_model_<model>[_<gpu>].json`` in ``MASKEDIT_PROFILES_DIR``, whose default is the source
checkout's ``perf_profiles/`` when the code runs from one (the repository's profiles; the container is one, at
/opt/maskedit) and the model directory otherwise (profiles shipped beside the weights).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable, Mapping

from .cost_model import profile_name

SERVING_DEFAULTS_FILE = "maskedit.json"
THREADS_PREFIX = "MASKEDIT_THREADS_"


def _checkout() -> Path | None:
    """The source checkout this package runs from (an editable install, the container's /opt/maskedit), or None
    when it was installed as a wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "common" / "maskedit_common").is_dir() else None


CHECKOUT = _checkout()


def default_model_dir() -> Path:
    """The tiny model ``make model`` builds: under the checkout's ``models/``, else under ``~/.cache/maskedit``."""
    base = CHECKOUT / "models" if CHECKOUT is not None else Path.home() / ".cache" / "maskedit" / "models"
    return base / "tiny-flux-fill"


def _shm(name: str) -> Path:
    return Path(f"/dev/shm/maskedit-{os.getuid()}") / name


@dataclass(frozen=True)
class CacheSettings:
    """The activation cache (``maskedit.cache``) and its store, the same in every model process (they share it)."""

    policy: str = "planner"
    mem_dir: Path = field(default_factory=lambda: _shm("activations"))
    mem_bytes: int = 4 << 30
    disk_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "maskedit" / "activations")
    disk_bytes: int = 32 << 30
    disk_free_fraction: float = 0.5
    # seconds between the store's recovery probes: a shrunk memory budget grows back, a degraded tier is cleared
    # once it takes a write again (nothing runs while every tier is healthy at its full budget)
    probe_s: float = 2.0
    budget_bytes: int = 1 << 30
    # An adapter request on a template recorded only without adapters reuses that recording's rows for its
    # unmasked tokens (approximate: they lack the adapters' effect; docs/lora.md measures it) instead of running a
    # template pass under its own adapter set. Off: exact.
    lora_base_reuse: bool = False

    @property
    def enabled(self) -> bool:
        return self.policy != "off"


@dataclass(frozen=True)
class BatchingSettings:
    """The denoise loop: its batching policy and queue (``maskedit.scheduler``, ``maskedit.engine``)."""

    policy: str = "continuous"
    max_batch: int = 4
    max_tokens_per_step: int = 1 << 30
    max_queue: int = 64
    reject_late: bool = True
    # every request answered or refused within this many seconds of its arrival: refused before any work when it is
    # predicted to be answered later (``maskedit.completion``); 60 s: what proxies in front of a service commonly
    # wait for an answer (nginx's proxy_read_timeout, a cloud load balancer's idle timeout). 0: no bound
    latency_bound_s: float = 60.0
    # how far another host's clock may differ from this one's: a request's stamp from there (its sender's time of
    # sending, ``maskedit.arrival``) is believed within this much; NTP keeps hosts within milliseconds
    clock_skew_s: float = 0.05
    max_wait_steps: int = 8
    fair_share: bool = True  # tenants share the denoise queue by weight (``maskedit.fair_share``)


@dataclass(frozen=True)
class ServiceSettings:
    """The model processes: logging, threads, the shared-memory boards between them, background timers."""

    log_level: str = "INFO"
    threads: tuple[tuple[str, int], ...] = ()  # (MODEL, threads) from MASKEDIT_THREADS_<MODEL>
    shutdown_grace_s: float = 10.0
    cancel_dir: Path = field(default_factory=lambda: _shm("cancel"))
    cancel_sweep_s: float = 60.0
    admission_dir: Path = field(default_factory=lambda: _shm("admission"))
    metrics_sync_s: float = 5.0

    def threads_for(self, model: str) -> int | None:
        """The threads ``MASKEDIT_THREADS_<MODEL>`` gives Triton model ``model``, if set."""
        return dict(self.threads).get(model.upper())


@dataclass(frozen=True)
class SecuritySettings:
    """The router's callers: API keys and TLS; the backends' one caller: the backend key (docs/security.md). None:
    off (open, plaintext)."""

    api_keys_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    backend_key_file: Path | None = None


@dataclass(frozen=True)
class Settings:
    """The model, the limits every request is checked against, and the sections of the serving parts."""

    model_dir: Path = field(default_factory=default_model_dir)
    resolution: int = 1024  # model works at about resolution**2 pixels, aspect kept, sides multiple of 16
    steps: int = 50  # default STEPS
    guidance: float = 30.0  # default GUIDANCE (Flux Fill's embedded guidance)
    max_sequence_length: int = 512  # T5 tokens; longer prompts are rejected
    max_steps: int = 100
    max_guidance: float = 100.0
    max_prompt_chars: int = 2000
    max_input_pixels: int = 4096 * 4096  # per image, checked from the header before decoding
    feather_px: int = 4  # soft edge of the compositing mask, in template pixels
    mask_threshold: int = 128  # mask pixels >= this (grayscale 0..255) are edited
    dtype: str = "float32"
    device: str = "auto"
    model_version: str = ""  # pins the cache key's model fingerprint (default: the weight files' size and mtime)
    cost_profile: Path | None = None  # the cost profile file (default: found in ``profiles``)
    profiles_dir: Path | None = None  # where cost profiles are (default: see ``profiles``)
    lora_dir: Path | None = None  # the adapter library (default: ``<model_dir>/loras``); no other path is opened
    # where ``/v1/load_lora_adapter`` may copy adapters from into the library (none: runtime loading is off)
    lora_roots: tuple[Path, ...] = ()
    max_loras: int = 4  # adapters per request
    max_lora_scale: float = 4.0  # a request's adapter scale must lie in [-max, max]
    lora_host_dir: Path | None = None  # the host tier of the adapter cache (default: see ``lora_host_cache_dir``)
    lora_host_bytes: int = 2 << 30  # its byte budget, shared by the host's processes (0: no host tier)
    lora_device_bytes: int = 1 << 30  # converted adapters one denoise process keeps on its device
    lora_load_threads: int = 2  # background adapter loads of one denoise process at a time
    lora_early_start: bool = False  # denoise before a request's adapters arrive, patch them in later (inexact)
    lora_merge: str = "auto"  # same-set calls: merge adapters into the weights by the cost model, always, never
    lora_merge_bytes: int = 1 << 30  # merged weight copies one denoiser keeps (per adapter set, LRU)
    # encoded prompts pre-processing keeps where the encoder reads the template too (Qwen-Image-Edit), LRU
    prompt_cache_bytes: int = 256 << 20
    controlnet_dir: Path | None = None  # the ControlNet library (default: ``<model_dir>/controlnets``)
    max_controls: int = 2  # ControlNets per request
    max_control_scale: float = 4.0  # a control's conditioning scale must lie in [0, max]
    max_reference_images: int = 4  # reference images per request (in-context edit models; the family caps it too)
    controlnet_placement: str = "inprocess"  # where ControlNets run: in the denoiser's process, or the `controlnet` model
    controlnet_timeout_s: float = 30.0  # a BLS call to the `controlnet` model fails its requests after this
    temporal: str = ""  # default TEMPORAL (temporal reuse policy, JSON; empty: off)
    cache: CacheSettings = field(default_factory=CacheSettings)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    service: ServiceSettings = field(default_factory=ServiceSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)

    @property
    def torch_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # only the backend asks

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def profiles(self) -> Path:
        """Where cost profiles are: ``MASKEDIT_PROFILES_DIR``, else the source checkout's ``perf_profiles/``, else
        the model directory."""
        if self.profiles_dir is not None:
            return Path(self.profiles_dir)
        if CHECKOUT is not None and (CHECKOUT / "perf_profiles").is_dir():
            return CHECKOUT / "perf_profiles"
        return Path(self.model_dir)

    def profile_path(self, slug: str, model_name: str | None = None) -> Path:
        """Where the cost profile of ``model_name`` (default: the served model's) measured on hardware ``slug``
        ("cpu", "h100", ...) is, or is written by calibration, in ``profiles``."""
        return self.profiles / profile_name(model_name or Path(self.model_dir).name, slug)

    def cost_profile_for(self, slug: str) -> Path:
        """The served model's cost profile on hardware ``slug``: ``MASKEDIT_COST_PROFILE`` if set, else
        ``profile_path(slug)``."""
        return Path(self.cost_profile) if self.cost_profile else self.profile_path(slug)

    @property
    def adapters(self) -> Path:
        """The LoRA adapter library: ``MASKEDIT_LORA_DIR``, else ``loras/`` in the model directory."""
        return Path(self.lora_dir) if self.lora_dir is not None else Path(self.model_dir) / "loras"

    @property
    def controlnets(self) -> Path:
        """The ControlNet library: ``MASKEDIT_CONTROLNET_DIR``, else ``controlnets/`` in the model directory."""
        return Path(self.controlnet_dir) if self.controlnet_dir is not None else Path(self.model_dir) / "controlnets"


    @property
    def lora_host_cache_dir(self) -> Path:
        """The adapter cache's host tier: ``MASKEDIT_LORA_HOST_DIR``, else ``adapters/`` beside the activation
        store's memory tier (``/dev/shm/maskedit-$UID/adapters`` by default)."""
        return Path(self.lora_host_dir) if self.lora_host_dir is not None else Path(self.cache.mem_dir).parent / \
            "adapters"


# -- the variables --------------------------------------------------------------------------------------------


def _bytes(v: str) -> int:
    return int(float(v))  # "4e9" as well as "4294967296"


def _paths(v: str) -> tuple[Path, ...]:
    return tuple(Path(p) for p in v.split(os.pathsep) if p.strip())


def _flag(v: str) -> bool:
    return v.strip() != "0"


@dataclass(frozen=True)
class Var:
    """One variable: the field it sets (``section.field``; empty for one that is not a setting), how its text
    is read, what it means, the default as the table shows it when the field's own reads poorly, and the values
    it may take."""

    name: str
    target: str
    parse: Callable[[str], object]
    doc: str
    default: str | None = None
    choices: tuple[str, ...] = ()


CONTROLNET_PLACEMENTS = ("inprocess", "triton")  # maskedit.controlnets.provider.PROVIDERS
CACHE_POLICIES = ("off", "planner", "planner_y")  # maskedit.cache.policy.POLICIES (a unit test keeps them equal)
BATCHING_POLICIES = ("continuous", "static", "priority")  # maskedit.scheduler.BatchScheduler.POLICIES
LORA_MERGE_MODES = ("auto", "always", "never")  # maskedit.adapters.merge.MODES

VARIABLES: tuple[Var, ...] = (
    # the model
    Var("MASKEDIT_MODEL_DIR", "model_dir", Path, "model directory loadable by `FluxFillPipeline`, "
        "`StableDiffusionXLInpaintPipeline` or `StableDiffusionInpaintPipeline.from_pretrained` (the family is read "
        "from its `model_index.json`)",
        "`models/tiny-flux-fill` in a source checkout, else `~/.cache/maskedit/models/tiny-flux-fill`"),
    Var("MASKEDIT_DEVICE", "device", str, "`auto`, `cpu`, `cuda`, `cuda:N`"),
    Var("MASKEDIT_DTYPE", "dtype", str, "compute dtype: `float32`, `bfloat16` (use it on GPUs), `float16`"),
    Var("MASKEDIT_RESOLUTION", "resolution", int, "working resolution: about this squared pixels, aspect kept"),
    Var("MASKEDIT_STEPS", "steps", int, "steps of a request that sends no `STEPS`"),
    Var("MASKEDIT_GUIDANCE", "guidance", float, "guidance of a request that sends no `GUIDANCE`"),
    Var("MASKEDIT_MAX_SEQUENCE_LENGTH", "max_sequence_length", int, "T5 tokens of a prompt; longer ones are refused"),
    Var("MASKEDIT_MODEL_VERSION", "model_version", str, "a version string added to the cache key's model "
        "fingerprint (the configs and the weight files' names, sizes and mtimes)", "none"),
    Var("MASKEDIT_COST_PROFILE", "cost_profile", Path,
        "the cost-model profile (a file) the engine plans with and the router predicts with",
        "`cost_model_<model>[_<gpu>].json` in the profiles directory"),
    Var("MASKEDIT_PROFILES_DIR", "profiles_dir", Path, "where cost profiles are found and calibration writes them; "
        "the router's default profile is the benchmark model's there",
        "`perf_profiles/` in a source checkout, else the model directory"),
    Var("MASKEDIT_LORA_DIR", "lora_dir", Path, "the LoRA adapter library: `<name>/` (Diffusers/PEFT) or "
        "`<name>.safetensors` (kohya) per adapter; requests name adapters, never paths, and no other directory is "
        "read", "`loras/` in the model directory"),
    Var("MASKEDIT_LORA_HOST_DIR", "lora_host_dir", Path, "the adapter cache's host tier: converted adapters "
        "shared by the host's model processes (a RAM filesystem)",
        "`adapters/` beside `MASKEDIT_CACHE_MEM_DIR` (`/dev/shm/maskedit-$UID/adapters`)"),
    Var("MASKEDIT_LORA_HOST_BYTES", "lora_host_bytes", _bytes, "bytes of the adapter cache's host tier (`0`: none)",
        "2 GiB"),
    Var("MASKEDIT_LORA_DEVICE_BYTES", "lora_device_bytes", _bytes, "bytes of converted adapters one denoise "
        "process keeps on its device", "1 GiB"),
    Var("MASKEDIT_LORA_LOAD_THREADS", "lora_load_threads", int, "background adapter loads one denoise process runs "
        "at a time"),
    Var("MASKEDIT_LORA_EARLY_START", "lora_early_start", _flag, "`1`: a request starts denoising before its "
        "adapters are loaded and they apply from the step after they arrive (faster, inexact; docs/lora.md)",
        "`0`"),
    Var("MASKEDIT_LORA_MERGE", "lora_merge", str, "a denoiser call whose requests all carry one adapter set: "
        "`auto` merges a projection's adapters into a copy of its weight where the cost model (measured on the "
        "device) says it pays, `always` merges every projection, `never` adds the deltas per row (docs/lora.md)",
        choices=LORA_MERGE_MODES),
    Var("MASKEDIT_PROMPT_CACHE_BYTES", "prompt_cache_bytes", _bytes, "bytes of encoded prompts one "
        "pre-processing process keeps per (prompt, template) where the prompt encoder reads the template too "
        "(`qwen_image_edit`), least recently used first out (`0`: none)", "256 MiB"),
    Var("MASKEDIT_LORA_MERGE_BYTES", "lora_merge_bytes", _bytes, "bytes of merged weight copies one denoiser "
        "keeps across calls (per adapter set, least recently used dropped first; a copy over it is made per call)",
        "1 GiB"),
    Var("MASKEDIT_LORA_ROOTS", "lora_roots", _paths, "directories (`:`-separated) the router's "
        "`/v1/load_lora_adapter` accepts a `lora_path` in (symlinks resolved); it copies the adapter from there into "
        "the library; no other path is opened", "none (runtime loading off)"),
    Var("MASKEDIT_CONTROLNET_DIR", "controlnet_dir", Path, "the ControlNet library: `<name>/` per ControlNet as "
        "`save_pretrained` writes it; requests name ControlNets, never paths, and no other directory is read",
        "`controlnets/` in the model directory"),
    # the limits every request is checked against
    Var("MASKEDIT_MAX_LORAS", "max_loras", int, "adapters one request may name in `LORAS`"),
    Var("MASKEDIT_MAX_LORA_SCALE", "max_lora_scale", float, "largest adapter scale magnitude accepted in `LORAS`"),
    Var("MASKEDIT_MAX_CONTROLS", "max_controls", int, "ControlNets one request may name in `CONTROLS`"),
    Var("MASKEDIT_MAX_CONTROL_SCALE", "max_control_scale", float, "largest conditioning scale accepted in "
        "`CONTROLS`"),
    Var("MASKEDIT_MAX_REFERENCE_IMAGES", "max_reference_images", int, "reference images one request may send in "
        "`REFERENCE_IMAGES` (in-context edit models; a family takes at most its own number: FLUX.1 Kontext one)"),
    Var("MASKEDIT_CONTROLNET_PLACEMENT", "controlnet_placement", str, "where a step's ControlNet residuals are "
        "computed: `inprocess` (the denoiser's process and device) or `triton` (the `controlnet` model, called "
        "through BLS; its own instance group)", choices=CONTROLNET_PLACEMENTS),
    Var("MASKEDIT_CONTROLNET_TIMEOUT_S", "controlnet_timeout_s", float, "seconds one BLS call to the `controlnet` "
        "model may take before the requests it served fail (naming `CONTROLS`)"),
    Var("MASKEDIT_TEMPORAL", "temporal", str, "default `TEMPORAL`: temporal reuse policy as JSON, e.g. "
        '`{"policy": "fbcache", "threshold": 0.08}` (empty: off; docs/caching.md)'),
    Var("MASKEDIT_MAX_STEPS", "max_steps", int, "largest `STEPS` accepted"),
    Var("MASKEDIT_MAX_GUIDANCE", "max_guidance", float, "largest `GUIDANCE` accepted"),
    Var("MASKEDIT_MAX_PROMPT_CHARS", "max_prompt_chars", int, "longest `PROMPT` accepted, in characters"),
    Var("MASKEDIT_MAX_INPUT_PIXELS", "max_input_pixels", int, "largest image accepted, in pixels (read from its "
        "header before decoding)", "4096² (16777216)"),
    Var("MASKEDIT_FEATHER_PX", "feather_px", int, "soft edge of the compositing mask, in template pixels"),
    Var("MASKEDIT_MASK_THRESHOLD", "mask_threshold", int, "mask pixels at or above this gray level (0-255) are "
        "edited; the router reads masks by it too, to price the region the backends edit (give both the same)"),
    # the activation cache
    Var("MASKEDIT_CACHE", "cache.policy", str, "cache policy: `planner` plans full / Y / KV per block, `planner_y` "
        "full / Y, `off` caches nothing", choices=CACHE_POLICIES),
    Var("MASKEDIT_CACHE_MEM_DIR", "cache.mem_dir", Path, "the store's memory tier (give containers `/dev/shm` room)",
        "`/dev/shm/maskedit-$UID/activations`"),
    Var("MASKEDIT_CACHE_MEM_BYTES", "cache.mem_bytes", _bytes, "bytes of the memory tier", "4 GiB"),
    Var("MASKEDIT_CACHE_DISK_DIR", "cache.disk_dir", Path, "the store's disk tier",
        "`~/.cache/maskedit/activations`"),
    Var("MASKEDIT_CACHE_DISK_BYTES", "cache.disk_bytes", _bytes, "bytes of the disk tier", "32 GiB"),
    Var("MASKEDIT_CACHE_DISK_FREE_FRACTION", "cache.disk_free_fraction", float, "the disk tier holds at most this "
        "share of the space its filesystem has"),
    Var("MASKEDIT_CACHE_PROBE_S", "cache.probe_s", float, "seconds between the store's recovery probes: a memory "
        "budget shrunk by a full filesystem grows back once the space returns, a degraded tier is cleared once a "
        "test write succeeds"),
    Var("MASKEDIT_CACHE_BUDGET_BYTES", "cache.budget_bytes", _bytes, "activation bytes recorded per template",
        "1 GiB"),
    Var("MASKEDIT_CACHE_LORA_BASE_REUSE", "cache.lora_base_reuse", _flag, "`1`: a request with LoRA adapters on a "
        "template cached only without adapters reuses that entry for its unmasked tokens (approximate, saves the "
        "template pass; see docs/lora.md); `0`: exact, it records its own", "`0`"),
    # batching and the queue
    Var("MASKEDIT_BATCHING", "batching.policy", str, "batching policy", choices=BATCHING_POLICIES),
    Var("MASKEDIT_MAX_BATCH", "batching.max_batch", int, "requests per denoising step"),
    Var("MASKEDIT_MAX_TOKENS_PER_STEP", "batching.max_tokens_per_step", int, "tokens computed per step",
        "no limit (2³⁰)"),
    Var("MASKEDIT_MAX_QUEUE", "batching.max_queue", int, "waiting requests before new ones get RESOURCE_EXHAUSTED"),
    Var("MASKEDIT_REJECT_LATE", "batching.reject_late", _flag, "refuse requests that cannot meet their deadline "
        "or bound (`0`: off)", "`1`"),
    Var("MASKEDIT_LATENCY_BOUND_S", "batching.latency_bound_s", float, "every request is answered or refused within "
        "this many seconds of its arrival: refused (`RESOURCE_EXHAUSTED`, with when to retry) before any work when "
        "the work ahead of it, at the step time measured now, would make it later, and when it reaches the front of "
        "the denoise queue too late; a request's `DEADLINE_MS` tightens it (`0`: no bound; docs/reliability.md)"),
    Var("MASKEDIT_CLOCK_SKEW_S", "batching.clock_skew_s", float, "how far another host's clock may differ from "
        "this server's: the bound counts from a request's send time as its sender stamped it (our client, the "
        "router: `maskedit_sent_at`), less this much when the stamp is another host's (docs/reliability.md)"),
    Var("MASKEDIT_MAX_WAIT_STEPS", "batching.max_wait_steps", int, "`priority`'s bound on how many steps a "
        "request waits"),
    Var("MASKEDIT_FAIR_SHARE", "batching.fair_share", _flag, "tenants (the router's `maskedit_tenant` parameter) "
        "share the denoise queue by weight (`0`: first come, first served)", "`1`"),
    # the processes
    Var("MASKEDIT_LOG_LEVEL", "service.log_level", str, "log level of the model processes"),
    Var(THREADS_PREFIX + "<MODEL>", "service.threads", int, "threads of one Triton model's process, e.g. "
        "`MASKEDIT_THREADS_MASKED_DENOISE`", "all cores for `masked_denoise`, 1 for the others"),
    Var("MASKEDIT_SHUTDOWN_GRACE_S", "service.shutdown_grace_s", float, "seconds the denoise loop may finish "
        "running requests when the server stops"),
    Var("MASKEDIT_CANCEL_DIR", "service.cancel_dir", Path, "cancel markers (the `cancel` model writes, denoise reads)",
        "`/dev/shm/maskedit-$UID/cancel`"),
    Var("MASKEDIT_CANCEL_SWEEP_S", "service.cancel_sweep_s", float, "seconds between sweeps of stale cancel markers"),
    Var("MASKEDIT_ADMISSION_DIR", "service.admission_dir", Path, "where the denoise queue's fill is published for "
        "early refusals in `preprocess`", "`/dev/shm/maskedit-$UID/admission`"),
    Var("MASKEDIT_METRICS_SYNC_S", "service.metrics_sync_s", float, "seconds between refreshes of the cache "
        "metrics"),
    # the router's callers
    Var("MASKEDIT_API_KEYS_FILE", "security.api_keys_file", Path, "the router's API key file (one key a line: key, "
        "tenant, role, limits; docs/security.md), re-read on change; unset: every caller is let in", "none"),
    Var("MASKEDIT_TLS_CERT", "security.tls_cert", Path, "PEM certificate (chain) of the router's gRPC and HTTP "
        "ports; with `MASKEDIT_TLS_KEY`: TLS on them", "none"),
    Var("MASKEDIT_TLS_KEY", "security.tls_key", Path, "PEM private key of that certificate", "none"),
    Var("MASKEDIT_BACKEND_KEY_FILE", "security.backend_key_file", Path, "a file holding the backends' shared secret: "
        "Triton then refuses every call but health without it in a header, which the router and the endpoint picker "
        "add (docs/security.md); unset: the backends take any caller (the launchers make one when API keys are on)",
        "none"),
    # not a setting
    Var("MASKEDIT_PYTHONPATH", "", str, "set by the launcher and the container, not by hand: import paths the "
        "Triton model shims put first on `sys.path` (the stub ignores `PYTHONPATH`); read by the shims before "
        "anything can be imported", "—"),
)

# Fields the model directory's maskedit.json may set (the model's own defaults; the environment overrides them).
MODEL_FILE_FIELDS = ("resolution", "steps", "guidance", "max_sequence_length", "max_steps", "max_guidance",
                     "max_prompt_chars", "max_input_pixels", "feather_px", "mask_threshold", "dtype", "device",
                     "model_version")
_SECTIONS = {"cache": CacheSettings, "batching": BatchingSettings, "service": ServiceSettings,
             "security": SecuritySettings}


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings of ``env`` (default: this process's environment). A variable that is not set takes the
    model directory's ``maskedit.json`` value where it has one, else the field's default."""
    env = os.environ if env is None else env
    model_dir = Path(env["MASKEDIT_MODEL_DIR"]) if env.get("MASKEDIT_MODEL_DIR") else default_model_dir()
    values: dict[str, dict] = {"": _family_defaults(model_dir), **{s: {} for s in _SECTIONS}}
    defaults_file = model_dir / SERVING_DEFAULTS_FILE
    if defaults_file.exists():
        values[""].update({k: v for k, v in json.loads(defaults_file.read_text()).items() if k in MODEL_FILE_FIELDS})
    for var in VARIABLES:
        if not var.target or var.target == "model_dir" or var.name.startswith(THREADS_PREFIX) or var.name not in env:
            continue
        value = var.parse(env[var.name])
        if var.choices and value not in var.choices:
            raise ValueError(f"{var.name}={value!r}: must be one of {', '.join(var.choices)}")
        section, _, name = var.target.rpartition(".")
        values[section][name] = value
    threads = tuple(sorted((k[len(THREADS_PREFIX):], int(v)) for k, v in env.items()
                           if k.startswith(THREADS_PREFIX) and len(k) > len(THREADS_PREFIX)))
    if threads:
        values["service"]["threads"] = threads
    return Settings(model_dir=model_dir, **values[""], **{s: cls(**values[s]) for s, cls in _SECTIONS.items()})


def _family_defaults(model_dir: Path) -> dict:
    """Defaults of an SD 2 / SDXL inpainting directory without a ``maskedit.json``: classifier-free guidance 7.5
    (Flux's 30 is an embedded guidance), CLIP's 77 tokens, the model's native resolution and usual steps."""
    index = model_dir / "model_index.json"
    try:
        name = json.loads(index.read_text()).get("_class_name") if index.exists() else None
    except (OSError, ValueError):
        return {}
    if name == "StableDiffusionXLInpaintPipeline":
        return {"guidance": 7.5, "max_sequence_length": 77, "resolution": 1024, "steps": 30}
    if name in ("FluxControlNetInpaintPipeline", "FluxPipeline"):  # FLUX.1-dev (flux_controlnet): guidance 3.5
        return {"guidance": 3.5, "steps": 28}
    if name == "StableDiffusionInpaintPipeline":
        return {"guidance": 7.5, "max_sequence_length": 77, "resolution": 512, "steps": 50}
    return {}


# -- the table in docs/settings.md ------------------------------------------------------------------------------

TABLE_BEGIN, TABLE_END = "<!-- settings table: begin -->", "<!-- settings table: end -->"


def _field_default(target: str):
    section, _, name = target.rpartition(".")
    f = {f.name: f for f in fields(_SECTIONS[section] if section else Settings)}[name]
    return f.default_factory() if f.default is MISSING else f.default


def table() -> str:
    """The markdown table of every variable (``†``: the model directory's ``maskedit.json`` may set its default)."""
    rows = ["| variable | setting | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        default = v.default if v.default is not None else f"`{_field_default(v.target)}`"
        if v.target in MODEL_FILE_FIELDS:
            default += " †"
        listed = all(f"`{c}`" in v.doc for c in v.choices)
        meaning = v.doc + ("" if listed else f"; one of {', '.join(f'`{c}`' for c in v.choices)}")
        setting = f"`{v.target}`" if v.target else "—"
        rows.append(f"| `{v.name}` | {setting} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def with_table(doc: str) -> str:
    """``doc`` with the text between its table markers replaced by ``table()``."""
    head, rest = doc.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{table()}{TABLE_END}{tail}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Print the table of MASKEDIT_* variables, or write it into a document "
                                 "between its markers.")
    ap.add_argument("--write", type=Path, help="a markdown file holding the table's markers (docs/settings.md)")
    args = ap.parse_args(argv)
    if args.write:
        args.write.write_text(with_table(args.write.read_text()))
    else:
        print(table(), end="")


if __name__ == "__main__":
    main()
