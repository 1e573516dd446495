"""Settings: one frozen, typed object built once at start-up and passed in, never reached for.

Sources, strongest first: explicit values (CLI flags), `LIFEGUARD_*` environment variables, the YAML
file named by `--config` (or `LIFEGUARD_CONFIG`), then the defaults below, which
`config/lifeguard.yaml` documents one by one (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from .urls import http_url, url_shown

OnSleeping = Literal["hold", "reject", "wake"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
RouteClass = Literal["inference", "at_once", "serialized", "never_gated"]
#: The `upstream` that guards the embedded simulator (lifeguard_sim) instead of a vLLM: only when asked for.
SIMULATOR = "sim"
#: The name of the one engine `upstream:` guards (its base URL is also `/engines/default/`).
DEFAULT_ENGINE = "default"


#: The lifecycle operations whose bodies carry weight-push metadata (`max_weight_update_body_bytes`).
WEIGHT_PUSH_OPERATIONS = frozenset({"update_weights", "collective_rpc"})


class EngineSettings(BaseModel):
    """One guarded engine: each of `engines:`, or the one `upstream:` names (`Settings.guarded_engines`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="The engine's name: the path segment of its own base URL, /engines/<name>/.",
    )
    upstream: str = Field(description="Its vLLM base URL (http:// or https://).")
    gpus: tuple[int, ...] = Field(
        default=(0,),
        min_length=1,
        description="Indices into the GPU reader's device list (NVML: device index) that the engine occupies.",
    )
    swap_sleep_level: Literal[1, 2] = Field(
        default=1,
        description=(
            "How it is put to sleep to make room for another engine: 1 offloads the weights to CPU memory; 2 "
            "discards them, and its next wake reloads them (collective_rpc reload_weights) and resets the prefix "
            "cache."
        ),
    )
    pinned: bool = Field(default=False, description="Never put to sleep to make room for another engine.")
    weights_gib: float | None = Field(
        default=None,
        gt=0,
        description=(
            "GPU memory its weights take: what a level-1 sleep copies into pinned host memory, counted against the "
            "host's before it is put to sleep to make room (docs/model-swap.md); null: not counted (vLLM does not say "
            "it)."
        ),
    )
    when_host_memory_short: Literal["refuse", "level_2"] = Field(
        default="refuse",
        description=(
            "What a swap does where this engine's level-1 sleep would pin more host memory than is available: refuse "
            "(503 insufficient_gpu_memory, saying so) or level_2 (discard its weights and reload them from disk at its "
            "wake: never for an engine whose weights a trainer updates)."
        ),
    )
    footprint_gib: float | None = Field(
        default=None,
        gt=0,
        description="GPU memory it takes awake, over all its GPUs; null: measured on its first verified wake.",
    )
    models: tuple[str, ...] = Field(
        default=(), description="Served model names routed to it; empty: read from its GET /v1/models."
    )
    on_sleeping: OnSleeping = Field(
        default="wake",
        description=(
            "What inference for it meets while it sleeps: hold, reject (503) or wake (swap it in); the top-level "
            "on_sleeping is not used."
        ),
    )

    @field_validator("upstream")
    @classmethod
    def _engine_upstream_is_http_url(cls, value: str) -> str:
        return http_url(value, or_else=f" ({SIMULATOR!r} is single-engine only)")

    @field_validator("gpus")
    @classmethod
    def _gpus_distinct(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(value)) != len(value) or min(value) < 0:
            raise ValueError(f"must be distinct device indices >= 0 (got {list(value)})")
        return value


class Settings(BaseSettings):
    """Everything the proxy can be told. Validated once; immutable afterwards."""

    model_config = SettingsConfigDict(env_prefix="LIFEGUARD_", frozen=True, extra="forbid", validate_default=True)

    # --- where we listen and what we guard
    upstream: str | None = Field(
        default=None,
        description=(
            "vLLM base URL (http:// or https://), or `sim` for the embedded simulator (never chosen by default); "
            "`serve` exits 2 without it (or `engines`), so a forgotten setting never guards a fake engine."
        ),
    )
    engines: tuple[EngineSettings, ...] = Field(
        default=(),
        description=(
            "Several engines sharing GPUs, instead of `upstream` (a single `upstream` is one engine named "
            "`default`, also at /engines/default/); one entry per engine, with the keys below (docs/model-swap.md)."
        ),
    )
    host: str = Field(
        default="127.0.0.1", description="Address the proxy listens on; the container image sets 0.0.0.0."
    )
    port: int = Field(
        default=8080, ge=0, le=65535, description="Port the proxy listens on (trainers point their vLLM base URL here)."
    )
    log_level: LogLevel = Field(default="info", description="Log verbosity: debug, info, warning or error.")
    log_format: LogFormat = Field(
        default="text", description="Log line format: text (for people) or json (for log collectors)."
    )
    # uvloop relays a request with less CPU than asyncio's own loop (docs/performance.md); asyncio's is the fallback.
    event_loop: Literal["uvloop", "asyncio"] = Field(
        default="uvloop",
        description="The event loop of `serve`: uvloop (less CPU per request) or asyncio (Python's own).",
    )

    # --- the data plane
    # One front (proxy/front/connection.py) serves every request of every engine.
    connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Seconds to open a TCP connection to vLLM before the attempt fails."
    )
    # uvicorn (vLLM) closes idle keep-alive sockets after 5 s; reusing one it just closed is an ECONNRESET.
    upstream_keepalive_s: float = Field(
        default=4.0,
        gt=0,
        lt=5.0,
        description="Seconds an idle pooled connection to vLLM is kept; must stay under uvicorn's 5 s.",
    )
    upstream_max_connecting: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Connections to vLLM being opened at once; more requests wait for one of them, or for a pooled "
            "connection that comes back (a burst of released held requests must not overflow vLLM's listen "
            "backlog). null: 1,024, or the kernel's net.core.somaxconn where that is lower (128 before Linux 5.4)."
        ),
    )
    upstream_max_connections: int = Field(
        default=0,
        ge=0,
        description=(
            "Open connections to vLLM at most, 0 for no cap (the default). Each is one client request's, and a "
            "stream holds its connection for its whole generation: the streams past a cap wait for another to end. "
            "RL batches are 2,048-4,096 streams at once; a cap, if one is needed (vLLM's file descriptors), belongs "
            "above the largest."
        ),
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="Largest request body accepted, in bytes (64 MiB)."
    )
    # The body of a weight push (/update_weights, /collective_rpc): an unpacked CUDA IPC push names every
    # parameter with one pickled handle per trainer GPU (vLLM 0.32 ipc_engine.py, packed=False, its default):
    # 2.7 KB a parameter on 8 GPUs (measured, torch 2.11 on an H200), 97 MiB for Qwen3-235B-A22B's ~37k
    # tensors. Bodies are held in memory while they are forwarded (about twice, briefly): keep it under half
    # the sidecar container's memory limit.
    max_weight_update_body_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description=(
            "Largest body of a weight push (/update_weights, /collective_rpc), in bytes (256 MiB): an unpacked CUDA"
            " IPC push carries one pickled handle per parameter and trainer GPU, 2.7 KB a parameter on 8 GPUs (97 "
            "MiB for Qwen3-235B-A22B). Held in memory while forwarded (about twice, briefly): keep it under half "
            "the sidecar container's memory limit."
        ),
    )
    # A client that has not finished its request headers this long after connecting (or after its last
    # answer on a kept-alive connection) is disconnected: a trickling client must not hold a socket forever.
    client_idle_timeout_s: float = Field(
        default=75.0,
        gt=0,
        description="Seconds a client connection may go without sending complete request headers before it is closed.",
    )
    client_body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds to receive a whole request body once its headers are in; then 408 body_timeout.",
    )
    max_held_requests: int = Field(
        default=10_000,
        ge=0,
        description="Most inference requests held at once while vLLM is not RUNNING; beyond that 503 hold_queue_full.",
    )
    # The bodies of held requests stay in memory until the engine is ready: their total is bounded too.
    max_held_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        description=(
            "Most body bytes of all held requests together (256 MiB); beyond that 503 hold_queue_full. Keep it well"
            " under the sidecar container's memory limit."
        ),
    )
    hold_timeout_s: float = Field(
        default=300.0, gt=0, description="Seconds a held request waits for RUNNING before 503 hold_timeout."
    )

    # --- the route table (proxy/front/route_table.py)
    unknown_routes: Literal["pass", "hold"] = Field(
        default="pass",
        description=(
            "A POST (or PUT, DELETE...) to a route neither vLLM nor a supported trainer serves: `pass` forwards it "
            "at once, as vLLM would see it (admin token required when set; counted in "
            "lifeguard_unknown_route_requests_total and logged once per path); `hold` treats it as inference (held "
            "while the engine is not RUNNING)."
        ),
    )
    routes: dict[RouteClass, tuple[str, ...]] = Field(
        default_factory=dict,
        description=(
            "Extra paths per class, for routes of your own server wrapper: inference (held unless RUNNING), at_once"
            " (control: forwarded at once, token), serialized (control that waits for a lifecycle transition to "
            'end), never_gated (read-only). A path, "/prefix/*" or "/x/{id}". Lifecycle paths cannot be '
            "reclassified."
        ),
    )

    # --- the control plane
    lifecycle_queue_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a lifecycle call waits for its turn behind another before 409 lifecycle_busy.",
    )
    gpu_lock_dir: str | None = Field(
        default=None,
        description=(
            "Several pods on one GPU node (docs/gpu-sharing-across-pods.md): a directory shared by every lifeguard "
            "on the node (a hostPath). Each wake, weight load, collective_rpc and KV release then holds a kernel "
            "lock on <dir>/<GPU UUID>.lock for its whole duration and is admitted against the device's free memory."
            " null: only this proxy's own lock per GPU. Needs the GPUs' UUIDs (gpu_probe nvml or file:, or "
            "gpu_devices)."
        ),
    )
    lifecycle_call_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="Seconds one upstream lifecycle call (sleep, wake_up, update_weights, ...) may take.",
    )
    control_call_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Seconds for the proxy's own short calls to vLLM (/health, /is_sleeping, /is_paused).",
    )
    weight_reload_rpc_methods: Annotated[tuple[str, ...], NoDecode] = Field(
        default=("reload_weights",),
        description='/collective_rpc methods that load weights and so clear the "weights stale" flag.',
    )
    weight_update_rpc_methods: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(
            "update_weights_nccl",
            "update_weights_ipc",
            "skyrl_start_weight_update",
            "skyrl_finish_weight_update",
        ),
        description=(
            "/collective_rpc methods that write weights: refused (409) while the weights are asleep, like "
            "/update_weights."
        ),
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description=(
            "Token required on lifecycle and weight routes (Authorization: Bearer), on /lifeguard/state and on the "
            "status page /lifeguard/ui (a sign-in form there); null leaves them open. Probes and metrics never need"
            " it."
        ),
    )

    # --- verification after every lifecycle 200
    verify_timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds to wait for vLLM's state to match after a lifecycle call answered 200."
    )
    verify_poll_interval_s: float = Field(default=0.05, gt=0, description="Seconds between polls while verifying.")
    gpu_probe: str = Field(
        default="nvml", description="GPU memory reader: nvml, file:PATH (e.g. the simulator's --gpu-file) or none."
    )
    gpu_devices: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description=(
            "GPUs to read (NVML indices or UUIDs); empty reads every GPU the probe can see. UUIDs here also name "
            "the GPUs for gpu_lock_dir where the probe cannot (no NVML)."
        ),
    )
    sleep_min_freed_fraction: float = Field(
        default=0.5, ge=0, le=1, description="Fraction of the memory a sleep must free to count as verified."
    )
    wake_min_restored_fraction: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="Fraction of the pre-sleep memory a full wake must restore to count as verified.",
    )
    weights_wake_min_fraction: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Fraction of the weights' memory a weights-only wake must bring back to count as verified.",
    )
    canary_enabled: bool = Field(
        default=True, description="Send a 1-token canary completion after a wake before releasing traffic."
    )
    canary_prompt: str = Field(default="The capital of France is", description="Prompt of the canary completion.")
    canary_timeout_s: float = Field(default=30.0, gt=0, description="Seconds the canary completion may take.")
    canary_max_logprob_drift: float = Field(
        default=2.0,
        gt=0,
        description="Largest change of the canary's logprob versus before the sleep that still passes.",
    )
    lora_check: bool = Field(
        default=True,
        description=(
            "Check after every full wake that the LoRA adapters vLLM served before the sleep are still listed by "
            "/v1/models and answer the canary as before (vLLM #53888: a level-1 sleep and wake can leave an adapter"
            " that answers like the base model). /v1/models is read in the reconcile rounds while RUNNING."
        ),
    )
    # Adapters given a canary answer; those past it are only checked to be listed after the wake.
    lora_canary_max_adapters: int = Field(
        default=8,
        ge=0,
        description=(
            "How many adapters get a canary answer (one 1-token completion each); the others are only checked to be"
            " listed."
        ),
    )
    weight_checksums: Literal["off", "reloads", "always"] = Field(
        default="reloads",
        description=(
            "vLLM's own weight checksums (POST /weight_checker, a SHA-256 per tensor) as verification "
            "(docs/verification.md): off never read them; reloads take the checkpoint's checksums while the weights "
            "are known to be the checkpoint's (this proxy saw vLLM start or restart), and compare every reload of the "
            "checkpoint (/collective_rpc reload_weights) with them: a reload that did not produce the checkpoint is "
            "503 and its weights held; always also before a level-1 sleep and after its wake (the weights must come "
            "back bit for bit), and around each weight update session (an update that changed nothing is a warning "
            "and a metric). Each checksum copies every tensor to the CPU and hashes it; docs/performance.md has the "
            "cost per GiB behind this default. A /weight_checker reset is held as zeroed weights whatever this says."
        ),
    )
    weight_checksum_timeout_s: float = Field(
        default=120.0, gt=0, description='Seconds one checksum read may take (then "unavailable", never a failure).'
    )
    # vLLM checks --api-key on /v1 routes only; the canary and model lookup are /v1 calls of our own.
    upstream_api_key: SecretStr | None = Field(
        default=None,
        description=(
            "vLLM's --api-key, sent (Authorization: Bearer) on the proxy's own canary and /v1/models calls; null: none."
        ),
    )

    # --- between calls
    reconcile_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between reconcile polls of vLLM's real state in settled states."
    )
    late_rounds_before_failed: int = Field(
        default=3,
        ge=1,
        description=(
            "Reconcile rounds in a row that vLLM leaves unanswered (control_call_timeout_s each) before the engine "
            "is FAILED: a busy API server answers late. A refused connection or a 503 fails it at the first round."
        ),
    )
    stall_after_s: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Seconds with inference requests in flight and no byte from vLLM, while RUNNING, after which the engine "
            "counts as stalled (field reports: hours at 0 tokens/s behind a /health 200): /lifeguard/serving says "
            "503 `stalled`, lifeguard_engine_stalled is 1 and a WARNING names the engine, until bytes flow again. "
            "Unset: not watched. Set it above the longest non-streaming request (it sends nothing until done)."
        ),
    )
    hold_while_weights_stale: bool = Field(
        default=False,
        description=(
            "Keep holding inference after vLLM restarted under the proxy (its weights are the initial checkpoint "
            "again) until a weight update or reload. Level-2 sleeps always hold until the weights are reloaded."
        ),
    )
    # Where the proxy keeps what vLLM cannot be asked for (weights discarded, a pause to re-apply), so that a
    # restarted proxy does not forget it; put it on a volume that outlives the container (an emptyDir).
    state_file: str | None = Field(
        default=None,
        description=(
            "File where the proxy keeps what vLLM cannot be asked for after a proxy restart (weights discarded by a"
            " level-2 sleep, a pause to re-apply on wake); on a volume that outlives the container. null: none "
            "kept."
        ),
    )

    # --- operating policies
    on_sleeping: OnSleeping = Field(
        default="hold",
        description="What an inference request meets while the engine sleeps: hold, reject (503) or wake.",
    )
    idle_sleep_after_s: float | None = Field(
        default=None, gt=0, description="Put the engine to sleep after this many idle seconds; null never does."
    )
    idle_sleep_level: int = Field(default=1, ge=0, le=2, description="Sleep level used by the idle sleep (0, 1 or 2).")
    drain_before_sleep_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Seconds to let in-flight requests finish before an abort-mode sleep (a client's or the idle sleep) is "
            "forwarded."
        ),
    )
    # Several engines on shared GPUs (proxy/sharing/arbiter.py): while requests for a sleeping engine wait, an awake
    # neighbour serves its own requests this long (from when they began waiting, or from its own wake), then
    # stops admitting, finishes what it serves and is put to sleep for them.
    swap_quantum_s: float = Field(
        default=10.0,
        ge=0,
        description=(
            "Several engines: while requests for a sleeping engine wait, an awake neighbour serves its own this "
            "many seconds (from when they began waiting, or from its own wake), then stops admitting, finishes and "
            "is put to sleep."
        ),
    )
    swap_drain_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "Seconds a neighbour put to sleep for a swap may take to finish what it serves; its sleep ends what is "
            "left."
        ),
    )
    host_backup_budget_gib: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Host memory the engines' level-1 sleep backups (pinned) may take in all, less what they are counted to "
            "hold now; null: /proc/meminfo's MemAvailable at each swap (set it where a container's memory limit, "
            "not the node, bounds the engines)."
        ),
    )

    # --- shutdown
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, description="Seconds in-flight streams get to finish after SIGTERM before the proxy exits."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_data_plane(cls, values: Any) -> Any:
        """`data_plane` chose between two fronts until 0.2; there is one now. `raw` (the one kept) is accepted
        so that existing files start unchanged."""
        if isinstance(values, dict) and "data_plane" in values:
            values = dict(values)
            if values.pop("data_plane") not in ("raw", None):
                raise ValueError(
                    "data_plane: the aiohttp data plane was removed; every request is served by the one front "
                    "(remove data_plane from the settings)"
                )
        return values

    @field_validator("upstream")
    @classmethod
    def _upstream_is_http_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if value == SIMULATOR:
            return value
        return http_url(value, or_else=f", or be {SIMULATOR!r}")

    def body_limit(self, lifecycle_op: str | None = None) -> int:
        """The largest body a request may carry: a weight push's is larger than anything else's."""
        if lifecycle_op in WEIGHT_PUSH_OPERATIONS:
            return max(self.max_body_bytes, self.max_weight_update_body_bytes)
        return self.max_body_bytes

    @property
    def upstream_shown(self) -> str | None:
        """The upstream URL as it may appear in logs and /lifeguard/state: without a password."""
        return None if self.upstream is None else url_shown(self.upstream)

    @field_validator("routes")
    @classmethod
    def _route_paths_are_paths(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for kind, paths in value.items():
            for path in paths:
                if not path.startswith("/") or "?" in path:
                    raise ValueError(f"routes.{kind}: {path!r} is not a path starting with '/'")
        return value

    @field_validator("gpu_probe")
    @classmethod
    def _gpu_probe_known(cls, value: str) -> str:
        if value in ("nvml", "none") or (value.startswith("file:") and len(value) > len("file:")):
            return value
        raise ValueError(f"must be nvml, none or file:PATH (got {value!r})")

    @field_validator("gpu_lock_dir")
    @classmethod
    def _gpu_lock_dir_absolute(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute path (got {value!r})")
        return value

    @field_validator("gpu_devices", "weight_reload_rpc_methods", "weight_update_rpc_methods", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("admin_token", "upstream_api_key")
    @classmethod
    def _secret_not_empty(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        # An empty token reads as set while it guards nothing; an empty key is sent to vLLM as one.
        if value is not None and not value.get_secret_value().strip():
            if info.field_name == "admin_token":
                raise ValueError("is set but empty: set a token, or unset it to leave the admin routes open")
            raise ValueError("is set but empty: set vLLM's --api-key, or unset it when vLLM has none")
        return value

    @model_validator(mode="after")
    def _gpu_lock_names_its_gpus(self) -> Settings:
        named = any(_is_uuid(device) for device in self.gpu_devices)
        if self.gpu_lock_dir is not None and self.gpu_probe == "none" and not named:
            raise ValueError(
                "gpu_lock_dir names each GPU's lock file by the GPU's UUID, and gpu_probe none reads no UUID: set "
                "gpu_probe to nvml or file:PATH (a file with each device's uuid), or gpu_devices to the GPUs' UUIDs"
            )
        return self

    @model_validator(mode="after")
    def _engines_consistent(self) -> Settings:
        if not self.engines:
            return self
        if self.upstream is not None:
            raise ValueError("set either upstream (one engine) or engines (several), not both")
        names = [engine.name for engine in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engines: names must be unique (got {names})")
        models = [model for engine in self.engines for model in engine.models]
        if len(set(models)) != len(models):
            raise ValueError(f"engines: a served model name may belong to one engine only (got {models})")
        return self

    def guarded_engines(self) -> tuple[EngineSettings, ...]:
        """Every engine this proxy guards: `engines:`, or the one `upstream:` names (called `default`, with the
        top-level `on_sleeping`). One engine or several, each is guarded the same way (proxy/lifecycle/engine.py)."""
        if self.engines:
            return self.engines
        if self.upstream is None or self.upstream == SIMULATOR:
            raise ValueError("no engine to guard: set upstream (an http(s) URL) or engines")
        return (EngineSettings(name=DEFAULT_ENGINE, upstream=self.upstream, on_sleeping=self.on_sleeping),)

    def for_engine(self, engine: EngineSettings) -> Settings:
        """The settings one engine is guarded with: its own upstream, `on_sleeping` and state file (with
        `engines:`, suffixed with its name: never one file for two engines), everything else shared."""
        named = bool(self.engines)
        return self.model_copy(
            update={
                "upstream": engine.upstream,
                "engines": (),
                "on_sleeping": engine.on_sleeping,
                "state_file": f"{self.state_file}.{engine.name}" if self.state_file and named else self.state_file,
            }
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        file_values = FILE_VALUES.get()
        if file_values is not None:
            sources.append(InitSettingsSource(settings_cls, init_kwargs=dict(file_values)))
        return tuple(sources)


def _is_uuid(device: str) -> bool:
    """A `gpu_devices` entry that names a GPU by its UUID (NVML's `GPU-...` or `MIG-...`), not by an index."""
    return not device.isdigit()


#: The values read from the YAML file of the `Settings` being built (proxy/config/sources.py sets it around the
#: construction): pydantic-settings builds its sources inside the class.
FILE_VALUES: ContextVar[Mapping[str, Any] | None] = ContextVar("FILE_VALUES", default=None)
