"""Service configuration: flags > ``CONVSERVE_*`` environment variables > a config file > defaults.

Every field below is a flag of ``convserve serve`` (``--max-body-bytes``), an environment variable
(``CONVSERVE_MAX_BODY_BYTES``) and a key of the config file (``max_body_bytes``, TOML or JSON, given by
``--config PATH`` or ``CONVSERVE_CONFIG``). Everything is validated at start-up, before the model is built;
a bad value stops the process with a message naming the setting and what it accepts.

With no configuration at all the service serves the embedded random model (4 conv layers, dim 1024, width 4,
bfloat16 weights, seed 0) on 127.0.0.1:8000, on CUDA when present and on the CPU otherwise.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
import typing
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from convserve.clients.protocol.wire import MAX_OBJECTS

from .cores import usable_cores as _usable_cores
from .engine.config import DEFAULTS as _ENGINE  # the engine's defaults (EngineConfig), without torch
from .config_checks import check_across
from .config_values import DEVICE_RE, ConfigError, check_key, default_replica_name, int_list, one_device
from .env_names import is_service_link, unknown_variables


def _cuda_count() -> int:
    """The CUDA devices torch sees (torch imported only here: a CPU-only list needs no torch in the supervisor)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


#: the longest wait a setting may ask for (a day): waits go to poll() and join() as milliseconds in a C int
MAX_WAIT_S = 86400.0


class Settings(BaseSettings):
    """All settings of one ``convserve serve`` process."""

    # allow_inf_nan: every float setting is finite (an infinite timeout would wait forever, and JSON has no inf)
    model_config = SettingsConfigDict(env_prefix="CONVSERVE_", extra="forbid", validate_default=True,
                                      case_sensitive=False, allow_inf_nan=False)

    # --- network
    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0 for all interfaces)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0 picks a free one)")
    uds: Optional[Path] = Field(None, description="also listen on this Unix socket path, for clients on this "
                                "machine (no TCP); made at start, removed at exit")
    api_key: Optional[SecretStr] = Field(None, description="when set, every /v1 and /v2 route (but "
                                                           "/v2/health/*) and /docs, /redoc, /openapi.json "
                                                           "need 'Authorization: Bearer <key>'; prefer "
                                                           "api_key_file or the environment to the command line")
    api_key_file: Optional[Path] = Field(None, description="a file holding the API key (a mounted secret)")
    replica_name: Optional[str] = Field(None, description="this replica's name, sent on every answer as "
                                        "X-Convserve-Replica; default the pod's name (env HOSTNAME), else the "
                                        "host name")

    # --- processes
    workers: Union[int, Literal["auto"]] = Field(
        "auto", description="HTTP worker processes in front of the engine processes; 'auto' is the usable cores "
        "minus one per engine, 1 to 8; 0 runs the engine inside the one HTTP process (no engine process)")
    devices: Optional[str] = Field(None, description="one engine process per entry: 'cuda:0,cuda:1', 'all' (every "
                                   "CUDA device, else the CPU), 'cpu,cpu'; repeat a device for several engines on "
                                   "it; unset: one engine on --device")
    shm_bytes: int = Field(256 << 20, ge=1 << 20, description="each worker's shared-memory arena for the tensors "
                           "it exchanges with the engines, in bytes (larger tensors travel inline, one more copy; "
                           "containers need a /dev/shm at least workers x this)")
    shm_pin: bool = Field(True, description="engine processes on a GPU page-lock the workers' arenas (in 32 MiB "
                          "chunks, as they are used) and copy a decode batch's x to the device and y back straight "
                          "from its block, with no host copy; off: every request is copied through the engine's "
                          "own pinned memory (the arenas' pages then stay as sparse as their use)")

    # --- model
    device: str = Field("auto", description="auto (CUDA if present, else CPU), cpu, cuda or cuda:N")
    weights: Optional[Path] = Field(None, description="the checkpoint's conv1d weights: a safetensors file, a "
                                    "sharded checkpoint's model.safetensors.index.json, or a directory holding "
                                    "either; when unset, random weights from --layers/--dim/--width/--seed")
    layers: Annotated[Union[int, list[int]], NoDecode] = Field(
        4, description="random model: number of conv layers, or their model layer indices ('0,2,5')")
    dim: int = Field(1024, ge=1, le=1 << 20, description="random model: channels per conv layer")
    width: int = Field(4, ge=2, le=8, description="random model: conv kernel width")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        None, description="weight dtype (random model default bfloat16; file default: as stored)")
    state_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        _ENGINE.state_dtype, description="conv state dtype (unset: the weight dtype; /v1/model says which)")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="random model: seed of the weights")

    # --- engine
    slots: Union[int, Literal["auto"]] = Field(_ENGINE.slots, description="session slots in the state pool, or "
                                               "'auto' (a fraction of free GPU memory)")
    max_batch_tokens: int = Field(_ENGINE.max_batch_tokens, ge=1,
                                  description="tokens per engine step, all requests together")
    max_batch_size: int = Field(_ENGINE.max_batch_size, ge=1, description="requests per engine step")
    max_queue_delay_us: int = Field(_ENGINE.max_queue_delay_us, ge=0,
                                    description="how long a step waits to fill a batch (µs)")
    max_prefill_tokens_per_step: Union[int, Literal["auto"]] = Field(
        _ENGINE.max_prefill_tokens_per_step, description="prefill tokens of one engine step (longer prefills run "
        "in chunks over several steps, taking turns), so that decodes wait for short steps only; 'auto': "
        "2^18 / dim on the CPU, 2^22 / dim on CUDA (multiples of 16), at most max_batch_tokens")
    decode_buckets: Annotated[list[int], NoDecode] = Field(
        list(_ENGINE.decode_buckets), description="decode batch sizes (CUDA graphs are captured for each), at "
        "most max_batch_size; unset: 1,2,4,...,256 below max_batch_size, and max_batch_size itself when that is "
        "less than 256")
    max_queue: int = Field(_ENGINE.max_queue, ge=1, description="queued requests before 429 queue_full")
    session_ttl_s: float = Field(_ENGINE.session_ttl_s, gt=0,
                                 description="idle seconds before a session's state is evicted (410 state_lost)")
    answer_store_bytes: int = Field(_ENGINE.answer_store_bytes, ge=0,
                                    description="bytes of answers kept per engine for retries of convs that "
                                    "carried a position (oldest dropped first)")
    max_evicted_ids: int = Field(_ENGINE.max_evicted_ids, ge=1, le=1 << 22,
                                 description="ids of evicted, lost and removed sessions remembered per engine (410 "
                                 "state_lost rather than 404; a removed id's request counters, for late_request)")
    request_clients_kept: int = Field(_ENGINE.request_clients_kept, ge=1, le=1024,
                                      description="per session, the clients (PREFIX of a PREFIX:N request_id) whose "
                                      "latest call is kept to refuse late copies (409 late_request); a late copy of "
                                      "a client past them runs")
    verify_ids_kept: int = Field(_ENGINE.verify_ids_kept, ge=1, le=1024,
                                 description="per session and layer, the last verifies' request_ids (other than "
                                 "PREFIX:N) kept to refuse their late copies")
    sessions_page_max: int = Field(1000, ge=1, description="most sessions in one page of GET /v1/sessions")
    request_timeout_s: float = Field(_ENGINE.request_timeout_s, gt=0, le=MAX_WAIT_S,
                                     description="seconds a conv or session operation may wait to start: one not "
                                     "started by then fails with 504 timeout and never runs (one already started "
                                     "always answers with its result)")
    engine_down_unhealthy_s: float = Field(300.0, ge=0, le=MAX_WAIT_S,
        description="with engine processes: /healthz answers 503 "
                    "once an engine has been down this many seconds since its process "
                    "died (it keeps failing to start), so that a liveness probe restarts "
                    "the server (0: never)")
    engine_busy_poll_us: Union[int, Literal["auto"]] = Field(
        "auto", description="with engine processes: after a message in or out, an engine process polls its socket "
        "this long before it sleeps, so that a request arriving meanwhile is read at once instead of after the "
        "wake-up of a sleeping CPU; it keeps one core busy while requests come closer together than this, none "
        "when idle; 'auto': 2000 when the usable cores leave one spare per engine beyond one per worker and per "
        "engine, else 0 (sleep at once)")
    engine_build_timeout_s: float = Field(600.0, gt=0, le=MAX_WAIT_S, description="with engine processes: seconds "
                                          "the start waits for every engine to build its model and warm up (CUDA "
                                          "graphs) before it gives up and exits 1")
    engine_stats_timeout_s: float = Field(2.0, gt=0, le=600, description="with engine processes: seconds a "
                                          "/metrics scrape waits for each engine's counters; an engine that does "
                                          "not answer in time is left out of that scrape and shows as not "
                                          "answering in /readyz")
    engine_reply_timeout_s: Optional[float] = Field(None, gt=0, le=MAX_WAIT_S,
        description="with engine processes: seconds an "
                    "HTTP worker waits for an engine's answer to a conv or session "
                    "operation before it answers 504 engine_timeout (the request "
                    "may have been applied); more than request_timeout_s; unset: "
                    "request_timeout_s + 60")
    caller_step_max_tokens: Optional[int] = Field(_ENGINE.caller_step_max_tokens, ge=0,
                                        description="the largest engine step (tokens) that the thread submitting "
                                        "its request runs itself, when the engine is idle and the step would "
                                        "start at once (a batch request, a steady lone caller): no hand-off to the "
                                        "engine thread and back; 0: every step on the engine thread; unset: 512 "
                                        "on CUDA, 0 on the CPU; at most max_batch_tokens")
    use_cuda_graphs: bool = Field(_ENGINE.use_cuda_graphs,
                                  description="replay decode steps and the batch, verify and prefill slots' "
                                  "launches from CUDA graphs (CUDA only)")
    verify_slots: bool = Field(_ENGINE.verify_slots,
                               description="a verify-only batch whose rows all have one length (2-8 tokens) "
                               "launches from one of 2 verify slots (CUDA: one graph replay); --no-verify-slots: "
                               "with the layer's other verify rows, through the token ring")
    prefill_slots: bool = Field(_ENGINE.prefill_slots,
                                description="a batch without verify rows launches from one of 2 prefill slots "
                                "(CUDA: one graph replay per slot, layer and token bucket; 2 pinned outputs of "
                                "max_batch_tokens rows); --no-prefill-slots: with the layer's other prefill rows, "
                                "through the token ring")
    multi_layer_decode: bool = Field(_ENGINE.multi_layer_decode,
                                     description="run a step's decodes of several layers as one launch "
                                     "(stacked weights) when they fit the largest decode bucket; "
                                     "--no-multi-layer-decode: one launch per layer")
    max_spec_tokens: int = Field(_ENGINE.max_spec_tokens, ge=1,
                                 description="most tokens of one speculative verify (k + 1)")
    gpu_timing_interval: int = Field(_ENGINE.gpu_timing_interval, ge=1,
                                     description="CUDA: time the GPU with events on every Nth engine step "
                                     "(kernel time metrics scale the sample); 1 times every step")
    gil_switch_interval_us: int = Field(500, ge=100, le=100_000, description="with --workers 0 only: Python's "
                                        "thread switch interval (sys.setswitchinterval; Python's default is 5000): "
                                        "how long the engine "
                                        "thread may wait for the GIL after each GPU call while the HTTP loop is "
                                        "busy")
    cpu_threads: int = Field(1, ge=1, le=1024, description="CPU serving: torch's intra-op threads for the "
                             "engine's ops (more help long prefills when cores are idle; they compete with the "
                             "HTTP loop otherwise)")
    pool_memory_fraction: float = Field(_ENGINE.pool_memory_fraction, gt=0, le=1,
                                        description="with --slots auto: the share of free GPU memory the state "
                                        "pool may take")

    # --- snapshots (docs/serving.md: Snapshots)
    state_dir: Optional[Path] = Field(None, description="directory of the session snapshots: every session is "
                                      "written there on SIGTERM (and every --snapshot-interval-s) and the newest "
                                      "good snapshot is restored at start; unset: no snapshots")
    snapshot_interval_s: Optional[float] = Field(None, gt=0, le=MAX_WAIT_S,
        description="with --state-dir: also write a "
                    "snapshot every this many seconds (what a kill -9 loses is "
                    "what changed since); unset: only on SIGTERM")
    snapshot_keep: int = Field(3, ge=1, le=1000, description="snapshot files kept per engine (newest first): a "
                               "torn or unreadable newest falls back to the one before")
    snapshot_timeout_s: float = Field(60.0, gt=0, le=MAX_WAIT_S,
        description="on SIGTERM, how long writing the final snapshot "
                    "may take, after the drain (the supervisor waits this much longer for "
                    "engine processes)")

    # --- HTTP limits
    max_body_bytes: int = Field(64 << 20, ge=1024, description="largest request body, or stream frame, "
                                                               "in bytes (413 above)")
    max_body_objects: int = Field(MAX_OBJECTS, ge=64, description="most objects (array and map entries, and the "
                                  "containers) in one body or frame (413 above): decoding stops there; at "
                                  "least 4 × max_batch_size + 64, what a full batch takes")
    client_shm: bool = Field(False, description="take a conv's x from a client's shared-memory segment on this "
                             "host (a tensor map with 'shm' instead of 'data'; y is written back there): the "
                             "body then carries no tensor bytes. Any client may then name a convserve-client-* "
                             "segment this server's user can open: turn it on for the frontends of this host")
    client_shm_segments: int = Field(64, ge=1, description="client shared-memory segment descriptors each HTTP "
                                     "process keeps open, and sealed segments each engine process keeps mapped "
                                     "(the least recently used one is closed past it)")
    client_shm_direct: bool = Field(True, description="with engine processes, a plain decode batch (no position) "
                                    "or a verify of one length for every session whose x lies in a sealed client "
                                    "segment in the model dtype goes to its engine by reference: the engine copies "
                                    "x from there, checks its copy for NaN/Inf and writes y over the block, and the "
                                    "HTTP worker copies nothing; off: x is copied into the worker's arena first")
    max_tokens_per_request: int = Field(8192, ge=1, description="largest T of one conv request, and of one "
                                        "session's slice of a batch (413 above); at most max_batch_tokens, "
                                        "which it follows when left unset")
    check_finite: bool = Field(_ENGINE.check_finite, description="reject x with NaN or Inf (422 non_finite)")
    stream_window: int = Field(256, ge=1, description="frames of one stream or WebSocket being computed at "
                                                      "once; the next frames wait to be read")
    shutdown_timeout_s: float = Field(30.0, ge=0, le=MAX_WAIT_S,
        description="on SIGTERM, how long to let in-flight work "
                    "finish before exiting")
    max_json_body_bytes: int = Field(2 << 20, ge=1024, description="largest JSON body (or JSON part of a /v2 "
                                     "request), in bytes (413 above): JSON is decoded in one C call that holds "
                                     "the interpreter for about 12 ms per MiB at worst; send tensors in msgpack")
    parse_offload_bytes: int = Field(1 << 20, ge=0, description="bodies and frames of at least this many bytes "
                                     "are decoded in a parser thread, off the event loop (0: every body; above "
                                     "max_body_bytes: none)")
    heap_keep_bytes: int = Field(16 << 20, ge=0, le=1 << 30, description="freed host memory (bodies, decoded "
                                 "tensors) kept mapped for the next requests, in bytes: a request of a steady "
                                 "size then costs no page faults; blocks of half of it or more (and of at least "
                                 "1 MiB) are mapped on their own and given back when freed (0: every block of "
                                 "1 MiB or more is given back, and each large request pays its page faults)")
    stream_buffer_bytes: int = Field(16 << 20, ge=1 << 16, description="answers of one stream or WebSocket "
                                     "waiting to be sent, in bytes: above it the server stops reading that "
                                     "stream's frames until its client reads (back-pressure)")

    # --- connections (each HTTP worker process applies these on its own)
    max_connections: int = Field(1024, ge=2, le=1 << 20, description="open connections per HTTP worker "
                                 "process; above it a new connection takes the place of the oldest one that is "
                                 "idle or still sending its headers, or is answered 503 and closed")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="seconds a connection may take to send a "
                                    "request's headers (from its first byte, or from connecting) before it is "
                                    "closed with 408")
    body_timeout_s: float = Field(60.0, gt=0, le=3600, description="seconds a request may take to send its "
                                  "whole body (after its headers) before it gets 408 and the connection closes")
    keep_alive_s: float = Field(30.0, gt=0, le=3600, description="seconds an idle keep-alive connection stays "
                                "open between requests")
    max_header_bytes: int = Field(64 << 10, ge=4096, le=16 << 20, description="bytes of a request's line and "
                                  "headers; above it the connection gets 431 and is closed")
    backlog: int = Field(2048, ge=16, le=1 << 16, description="the listening socket's accept queue (the kernel "
                         "caps it at net.core.somaxconn)")

    # --- logs
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    access_log: bool = Field(False, description="log one JSON line per HTTP request")

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v):
        v = int_list(v, "layers")
        if isinstance(v, int):
            if v < 1:
                raise ValueError("layers: a count must be >= 1")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("layers: give a count (4) or a non-empty list of layer indices (0,2,5)")
        return v

    @field_validator("layers")
    @classmethod
    def _layers_unique(cls, v):
        if isinstance(v, list):
            if any(i < 0 for i in v):
                raise ValueError("layers: layer indices must be >= 0")
            if len(set(v)) != len(v):
                raise ValueError(f"layers: duplicate layer index in {v}")
        return v

    @field_validator("decode_buckets", mode="before")
    @classmethod
    def _buckets(cls, v):
        v = int_list(v, "decode_buckets")
        return [v] if isinstance(v, int) else v

    @field_validator("decode_buckets")
    @classmethod
    def _buckets_sorted(cls, v):
        if not v or any(b < 1 for b in v):
            raise ValueError("decode_buckets: give positive batch sizes, e.g. 1,2,4,8")
        return sorted(set(v))

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v, info):
        """A boolean given for a number (or in a list of numbers) is an error, not 1 or 0 (JSON's ``true`` for
        ``max_queue``, say)."""
        if isinstance(v, bool) or (isinstance(v, (list, tuple)) and any(isinstance(b, bool) for b in v)):
            ann = cls.model_fields[info.field_name].annotation
            kinds = {ann, *typing.get_args(ann)}
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"{info.field_name}: expected a number, not a boolean")
        return v

    @field_validator("workers", "slots", "max_prefill_tokens_per_step", "engine_busy_poll_us", mode="before")
    @classmethod
    def _int_or_auto(cls, v, info):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if not isinstance(v, (str, int)):       # a file's 1.5 or [1]: one line, not one per branch of the union
            raise ValueError(f"{info.field_name}: {v!r:.60} is neither an integer nor 'auto'")
        if isinstance(v, str) and v.strip().lower() != "auto":
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"{info.field_name}: {v!r} is neither an integer nor 'auto'") from None
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("slots")
    @classmethod
    def _slots_positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("slots: need at least 1 session slot")
        return v

    @field_validator("max_prefill_tokens_per_step")
    @classmethod
    def _prefill_budget_positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("max_prefill_tokens_per_step: need at least 1 token per step")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        v = v.strip().lower()
        if not DEVICE_RE.match(v):
            raise ValueError(f"device: {v!r} is not one of auto, cpu, cuda, cuda:N")
        return v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v):
        if v is not None and not (v.is_file() or v.is_dir()):
            raise ValueError(f"weights: {v} is neither a file nor a directory; give a safetensors file, a sharded "
                             "checkpoint's index or its directory, or leave it unset for the random model")
        return v

    @field_validator("state_dir")
    @classmethod
    def _state_dir(cls, v):
        if v is not None and v.exists() and not v.is_dir():
            raise ValueError(f"state_dir: {v} exists and is not a directory")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, v):
        return v.lower() if isinstance(v, str) else v

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v):
        if v is not None and not v.get_secret_value().strip():   # an unset shell variable: not "no auth"
            raise ValueError("api_key: the key is empty; give one (python -c 'import secrets; "
                             "print(secrets.token_urlsafe())'), or leave the setting out to serve without one")
        if v is not None:
            check_key(v.get_secret_value(), "api_key")
        return v

    @model_validator(mode="after")
    def _key_file(self):
        if self.api_key_file is not None:
            if self.api_key is not None:
                raise ValueError("api_key and api_key_file are both set; give the key one way")
            try:
                key = self.api_key_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--api-key-file / CONVSERVE_API_KEY_FILE: cannot read {self.api_key_file} "
                                 f"({type(e).__name__}); mount the key's file there or fix the path") from None
            if not key:
                raise ValueError(f"--api-key-file / CONVSERVE_API_KEY_FILE: {self.api_key_file} is empty")
            check_key(key, f"--api-key-file / CONVSERVE_API_KEY_FILE: the key in {self.api_key_file}")
            self.api_key = SecretStr(key)
        return self

    @field_validator("replica_name")
    @classmethod
    def _replica_name(cls, v):
        # a header value: visible ASCII, no spaces (a pod name, a host name, an address)
        if v is None:
            return default_replica_name()
        if not re.fullmatch(r"[!-~]{1,253}", v):
            raise ValueError(f"replica_name: {v!r:.80} must be 1 to 253 visible ASCII characters without spaces")
        return v

    @field_validator("workers")
    def _workers(cls, v):
        if v != "auto" and not 0 <= v <= 64:
            raise ValueError(f"workers: {v} is outside 0..64 (or 'auto')")
        return v

    @field_validator("engine_busy_poll_us")
    def _busy_poll(cls, v):
        if v != "auto" and not 0 <= v <= 1_000_000:
            raise ValueError(f"engine_busy_poll_us: {v} is outside 0..1000000 (or 'auto')")
        return v

    @field_validator("devices", mode="before")
    def _devices(cls, v):
        if v is None:
            return None
        if isinstance(v, (list, tuple)):
            v = ",".join(str(d) for d in v)
        v = str(v).strip()
        if v in ("", "auto"):
            return None
        if v != "all":
            for d in v.split(","):
                if not DEVICE_RE.match(d.strip()) or d.strip() == "auto":
                    raise ValueError(f"devices: {d.strip()!r} is not a device; use cpu, cuda or cuda:N, "
                                     "comma-separated, or 'all'")
        return v

    @model_validator(mode="after")
    def _cross(self):
        return check_across(self)

    # --- derived

    def engine_reply_timeout(self) -> float:
        """Seconds a worker waits for an engine's answer (``engine_reply_timeout_s``, or its default)."""
        return self.engine_reply_timeout_s if self.engine_reply_timeout_s is not None else \
            self.request_timeout_s + 60.0

    def resolved_device(self) -> str:
        if self.device != "auto":
            if self.device.startswith("cuda"):
                import torch

                if not torch.cuda.is_available():
                    raise ConfigError("device: CUDA was asked for but torch sees no CUDA device; use --device cpu "
                                      "or auto")
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_devices(self) -> list[str]:
        """One device per engine process."""
        if self.devices is None:
            return [self.resolved_device()]
        n_cuda = _cuda_count() if "cuda" in self.devices or self.devices == "all" else 0
        if self.devices == "all":
            out = [f"cuda:{i}" for i in range(n_cuda)] or ["cpu"]
        else:
            out = [one_device(d.strip(), n_cuda) for d in self.devices.split(",")]
        if self.workers == 0 and len(out) > 1:
            raise ConfigError(f"devices: {len(out)} engines ({','.join(out)}) were asked for, but --workers 0 runs "
                              "one engine inside the HTTP process; give workers (auto or N >= 1) for one engine "
                              "process per device, or one device")
        return out

    def max_decode_rows(self) -> int:
        """The one-token plain rows a batch with verify rows may carry: they run in the layer's decode launch, so
        at most the largest decode bucket, and a batch holds at most max_batch_size sessions (the checks keep the
        largest bucket within it; a copy made without them may not)."""
        return min(max(self.decode_buckets), self.max_batch_size)

    def resolved_workers(self, n_engines: int) -> int:
        if self.workers != "auto":
            return self.workers
        return max(1, min(8, _usable_cores() - n_engines))

    def resolved_busy_poll_us(self, n_engines: int) -> int:
        """``engine_busy_poll_us``, 'auto' resolved: polling only where a core is left for it (the workers and
        the engines' own threads have one each first)."""
        if self.workers == 0:
            return 0                  # no engine processes: the engine runs in the HTTP process
        if self.engine_busy_poll_us != "auto":
            return self.engine_busy_poll_us
        return 2000 if _usable_cores() >= self.resolved_workers(n_engines) + 2 * n_engines else 0

    def api_key_value(self) -> Optional[str]:
        return self.api_key.get_secret_value() if self.api_key is not None else None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        def env_without_service_links() -> dict:
            values = env_settings()
            if is_service_link("CONVSERVE_PORT", os.environ.get("CONVSERVE_PORT", "")):
                values.pop("port", None)
            return values
        return (init_settings, env_without_service_links, _FileSource(settings_cls))



#: settings whose values never appear in an error message or a log
SECRET_FIELDS = ("api_key",)


_file_data: dict = {}


class _FileSource(PydanticBaseSettingsSource):
    """The config file's keys, set by :func:`load_settings` (lowest priority above the defaults)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ is used instead
        return _file_data.get(field_name), field_name, False

    def __call__(self) -> dict:
        return dict(_file_data)


def read_config_file(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} " + ("is a directory: give the file's path" if path.is_dir()
                                                     else "does not exist"))
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path}: use a .toml or .json file")
    raw = path.read_bytes()
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a table of settings")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {unknown}; see `convserve serve --help`")
    return data


def load_settings(overrides: Optional[dict] = None, config_file: Optional[Path] = None) -> Settings:
    """Build the settings from flags (``overrides``), the environment and ``config_file``.

    ``config_file`` defaults to ``$CONVSERVE_CONFIG``. Raises :class:`ConfigError` with one line per problem.
    """
    from pydantic import ValidationError

    global _file_data
    unknown = unknown_variables(os.environ, Settings.model_fields)
    if unknown:         # a misspelt variable would otherwise leave its setting at its default, unnoticed
        raise ConfigError(f"unknown environment variable(s) {', '.join(unknown)}: no such setting (the settings are "
                          "the flags of `convserve serve --help`, as CONVSERVE_<NAME>); fix or unset them")
    if config_file is None and os.environ.get("CONVSERVE_CONFIG"):
        config_file = Path(os.environ["CONVSERVE_CONFIG"])
    _file_data = read_config_file(config_file) if config_file is not None else {}
    try:
        return Settings(**(overrides or {}))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            msg = err["msg"].removeprefix("Value error, ")
            flag = "--" + loc.replace("_", "-") if loc in Settings.model_fields else loc
            env = "CONVSERVE_" + loc.upper() if loc in Settings.model_fields else ""
            where = f"{flag} / {env}" if env else flag
            if loc in _file_data and loc not in (overrides or {}) and env not in os.environ:
                where += f" (in config file {config_file})"
            # the value only for a field that is not a secret: a secret's (or the whole input's) never shows
            shown = loc in Settings.model_fields and loc not in SECRET_FIELDS
            if loc == "settings" and msg.startswith("--"):      # a check across settings that names its own
                lines.append(msg)
                continue
            lines.append(f"{where}: {msg}" + (f" (got {err.get('input')!r:.200})" if shown else ""))
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
    finally:
        _file_data = {}
