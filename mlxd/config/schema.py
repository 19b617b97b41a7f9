"""The daemon config, as msgspec structs. Unknown fields are errors; every field has a safe default."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


# Upper bounds below keep a value from exhausting or crashing the process (and keep out TOML's inf and nan);
# every one is far above what serving needs. `mlxd check-config` names the file and the field of one outside them.
DAY_S = 86_400.0
MAX_TOKENS = 2**24  # a context or output length beyond every model's (16.7M tokens)


class ServerConfig(Base):
    host: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8080
    # A body is held whole in memory and decoded into objects several times its size: at most 1 GiB.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=1024**3)] = 16 * 1024 * 1024
    # Seconds of silence after which a streaming response gets an SSE comment, so proxies keep it open.
    keepalive_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    cors_origins: list[str] = []
    # On SIGTERM: stop accepting (503 with Retry-After), let running requests finish for this long, then end the
    # rest with a final error event and exit 0. A second signal exits at once.
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=DAY_S)] = 30.0
    # API keys, one per line (blank lines and `#` comments ignored; relative to the config's folder); the
    # MLXD_API_KEYS environment variable adds comma-separated ones. With no keys at all the API is open.
    api_keys_file: str = ""
    # Keys for /v1/status request details, DELETE /v1/cache and the page at /; MLXD_ADMIN_KEYS adds more. With
    # none, every API key is an admin key.
    admin_keys_file: str = ""
    # /metrics asks for an API key too (it is open by default, for scrapers).
    metrics_need_key: bool = False
    # /v1/status shows each request's rendered prompt (clipped) to requests carrying a key from admin_keys_file or
    # MLXD_ADMIN_KEYS. Off, or without such keys, no one sees prompts there.
    status_shows_prompts: bool = False
    # Bound to a loopback address, requests whose Host header names neither a loopback name (localhost, 127.0.0.1,
    # [::1]) nor one of these are refused (403): another web page's script cannot reach the daemon through a name
    # of its own that resolves here (DNS rebinding). Names without a port; "*" turns the check off.
    allowed_hosts: list[str] = []
    # Connections (mlxd/runtime/connections.py), before any key is checked: a request line and headers larger than
    # this get 431; a connection that has not sent a request's complete headers this long after it opened (or after
    # its previous response) is closed; a body not complete this long after its headers gets 408.
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=16 * 1024**2)] = 64 * 1024
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    # Connections served at once; one more is closed as soon as it is accepted. 0: the descriptor limit (raised to
    # its hard limit at start-up) less a reserve of 64 or an eighth of it, at most 4096.
    max_connections: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    # Threads that prepare requests (chat template, tokenizer, image decoding), apart from every other thread;
    # 0: min(4, CPU count).
    prepare_workers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # Requests waiting for or in preparation; one more gets 429 with Retry-After. They also count against the
    # engine's queue ([engine] max_running + max_waiting). 0: that sum.
    max_preparing: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    # Messages (Responses: input items) one request may carry; more is a 400 before any work on it.
    max_messages: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10_000
    # Several models ([models.NAME]): bytes all loaded models may hold together, each its weights, KV reservations and
    # prefix cache; a model that does not fit unloads the least recently used idle, unpinned ones, else its request
    # gets 503 with Retry-After; caches that grow past it unload idle ones too (then prefix-cache entries go), and no
    # model's own [engine] memory_limit_bytes exceeds it. 0: no bound.
    models_memory_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**50)] = 0


class SamplingDefaults(Base):
    """Used when a request leaves a field out. Unset (None) fields are resolved when the model loads: the model's
    own generation_config.json, else mlxd's (mlxd/models/generation_config.py); repetition_penalty 0 is off."""

    # The ranges a request may ask for (mlxd/api/schemas.py), so that a default never fails every request.
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0, le=10)] | None = None
    # mlxd's own: a model's max_new_tokens is a cap, not an answer length.
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] = 1024


class ModelConfig(Base):
    # A local MLX folder, a .gguf file, or "embedded:smollm2-135m".
    source: str
    # "embedding": an mlx-lm text model served at POST /v1/embeddings only (its chat endpoints answer 400), its last
    # hidden state pooled into one vector per input (mlxd/engine/embedding.py).
    kind: Literal["auto", "text", "vision", "embedding"] = "auto"
    name: str = ""
    # Glob patterns (fnmatch): agents send their own model ids, e.g. "claude-*" or "gpt-4*".
    aliases: list[str] = []
    # A Jinja chat template (inline text, or a path to a file) that replaces the model's own.
    chat_template: str = ""
    # Bounds on rendering the chat template (the model's or `chat_template`): a render that runs longer, or builds
    # a value or a prompt larger, is refused with a 400 and logged (mlxd/pipeline/render.py).
    template_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0
    template_max_bytes: Annotated[int, msgspec.Meta(ge=1024**2, le=4 * 1024**3)] = 64 * 1024**2
    # Prompt + completion tokens a request may use. 0: the trained length from the model's config.json
    # (max_position_embeddings). Above the trained length is allowed (for RoPE-scaled use) but logged as a warning.
    context_length: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)] = 0
    # "auto": float32 on Linux CPU (fast with OpenBLAS), the model's own dtype elsewhere.
    dtype: Literal["auto", "native", "float32", "float16", "bfloat16"] = "auto"
    # CUDA: products of 2-16 rows (batched decode steps) through mlxd's own kernel instead of cuBLASLt, whose host
    # cost bounds a batched step (mlxd/runtime/small_batch.py). bfloat16/float16 weights only; no effect elsewhere.
    small_batch_kernel: bool = True
    # The device this process serves on, as MLX numbers the ones it sees: "gpu:N", "gpu" (gpu:0), "cpu", or "auto":
    # the first GPU (the CPU without one); in a [distributed] job, each rank its own GPU on its host. Checked at
    # start-up against the devices MLX reports (mlxd/runtime/device.py).
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|gpu)(:[0-9]+)?$")] = "auto"
    sampling: SamplingDefaults = SamplingDefaults()
    # kind = "embedding": "last" pools the hidden state of each input's last token after the final norm (as
    # Qwen3-Embedding does), "mean" averages it over the input's tokens, "cls" takes the first token's; "auto": "last"
    # for mlx-lm models, "mean" for BERT-family encoders (mlx-embeddings). Vectors are L2-normalized unless `normalize`
    # is false. An input longer than context_length is a 400 naming it, or is cut to its first tokens with `truncate`.
    # `dimensions_allowed`: requests may ask for fewer `dimensions` (Matryoshka-trained models: the first N
    # features, renormalized); otherwise asking for dimensions is a 400.
    pooling: Literal["auto", "last", "mean", "cls"] = "auto"
    normalize: bool = True
    truncate: bool = False
    dimensions_allowed: bool = False


class SpeculativeConfig(Base):
    """Speculative decoding (``[engine.speculative]``): rows draft tokens and verify them in the batched step."""

    # What proposes the tokens: "none" (off), "prompt_lookup" (n-grams of the prompt and output so far),
    # "draft_model" (a small mlx-lm model, `draft_model`), "mtp" (the checkpoint's multi-token-prediction heads).
    drafter: Literal["none", "prompt_lookup", "draft_model", "mtp"] = "none"
    # Tokens drafted per step (the most, when `adaptive`).
    k: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # Draft length follows each row's acceptance, and a row whose acceptance falls under `min_acceptance` backs off
    # to plain steps for a while; false: always draft `k` (for measuring).
    adaptive: bool = True
    min_acceptance: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    # Positions one step may verify (rows x (1 + drafts)); drafts shorten to fit, down to none when the batch is full.
    max_step_tokens: Annotated[int, msgspec.Meta(ge=2, le=4096)] = 64
    # Requests speculate unless their body says `"speculative": false`; false: only those that say true.
    default: bool = True
    # prompt_lookup: the longest and shortest n-gram matched against the earlier tokens.
    ngram_max: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3
    ngram_min: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    # draft_model: an mlx-lm model folder (relative to the config's folder) sharing the served model's tokenizer.
    draft_model: str = ""


class EngineConfig(Base):
    type: Literal["batched"] = "batched"
    # Requests decoding together in one batch; more wait in the queue. 0: derived at start-up from the memory
    # budget (rows of 4096 tokens that fit beside the weights and the prefix cache, a power of two up to 64), and
    # logged as `max_running` with its source and inputs. At most 1024.
    max_running: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    # Requests allowed to wait for a running slot; beyond this new requests get 429 with Retry-After.
    max_waiting: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    # The most choices one request may ask for (`n`); each is a request of its own in the batch.
    max_n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 8
    # Tokens one engine step processes: one per decoding request, the rest for prompt chunks (at least one
    # chunk a step). Smaller keeps running streams smoother while long prompts arrive.
    step_token_budget: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 512
    # A request that finds the engine idle waits until no other request has arrived for this long and none is being
    # prepared (at most ten times it, fifty while requests are being prepared), so that requests sent together start
    # in one prompt pass; 0 starts each at once.
    gather_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 2.0
    # Prompt tokens per forward pass (the prefill stage's chunks, and the chunk warm-up compiles for); smaller
    # chunks let running streams interleave sooner. The only place this is set. At most 8,192 (mlx-lm's own default
    # is 2,048): where attention is not fused (MLX's CPU backend) a pass holds heads x chunk x (chunk + cached)
    # float32 scores, measured 1.13 GiB for a 4-head model at 8,192, so 8 GiB for 32 heads; warm-up runs a whole
    # chunk before the server is ready (1,000,000 asked for terabytes and crashed the process).
    prefill_chunk: Annotated[int, msgspec.Meta(ge=1, le=8192)] = 512
    # Rotating KV cache size (tokens); 0 keeps the whole context.
    max_kv_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)] = 0
    # Keys and values of attention layers held at this many bits a feature (plus a scale and a bias per group of
    # kv_group_size features), in the decode batch and the prefix cache alike: 8 bits take about half the bytes of
    # 16, 4 bits about a quarter (mlxd/cache/quantized.py). Unset: the model's dtype. Refused at start-up, with the
    # reason, where a model's caches or attention cannot be quantized (sliding-window layers, vision models, head
    # sizes that are not a multiple of kv_group_size, attention sinks) and with max_kv_size.
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    # Token hand-overs to the server's streams a second, in all (mlxd/engine/pacing.py): each wakes a stream's task,
    # whose Python holds the interpreter lock the engine thread needs for its next step. With more streams than this
    # allows one hand-over a token, each stream gets its tokens together every streams / this seconds (64 streams:
    # every 64 ms, one frame for what came meanwhile); first tokens and ends are never held. 0: every token at once.
    stream_updates_per_s: Annotated[float, msgspec.Meta(ge=0, le=1_000_000)] = 1000.0
    # Decode steps per batch size during warm-up, before /health turns ready.
    warmup_tokens: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # Decode steps and prompt groups run at bucketed row counts (1, 2, 4, 8, then multiples of 8), padded with inert
    # rows, so that warm-up meets every shape in bounded time (mlxd/engine/step/buckets.py). "groups": prompt groups
    # only. "auto": "on" on GPU backends, which build kernels per shape; "off" on the CPU, where a padded row costs
    # its full compute.
    batch_buckets: Literal["auto", "on", "groups", "off"] = "auto"
    # Prefix cache: bytes of reusable prompt state (KV snapshots) kept across requests; 0 turns it off.
    prefix_cache_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 2 * 1024**3
    # A cached state covering fewer prompt tokens than this is not reused: it saves less than it costs, since a
    # prompt that starts from a cached state runs in a pass of its own kind (with the rests of other such prompts),
    # not in one pass with the whole prompts arriving with it (a chat template's first tokens, or a short system
    # prompt, are shared by many requests). On an H200 (8B shape) bursts of 64 prompts in which 2-3 started from a
    # 32-token state waited 0.27-0.40 s for their pass of rests (first tokens p50 0.85-0.96 s against 0.57-0.60 s)
    # to save 64-96 tokens (docs/benchmarks/engine.md).
    prefix_cache_min_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] = 64
    # The prefix cache's disk tier (mlxd/cache/disk.py): a folder (relative to the config's folder) where entries
    # evicted from memory are written in the background, and those still in memory on a clean stop; a restarted
    # daemon finds them. Files are per model identity (weights digest, kv_bits, max_kv_size) in a subfolder, checked
    # before use (a bad one is a miss, deleted and logged). Empty: no disk tier. Needs prefix_cache_bytes > 0.
    prefix_cache_dir: str = ""
    # Bytes of files the disk tier keeps for this model; the least recently used are deleted beyond it.
    prefix_cache_disk_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**50)] = 16 * 1024**3
    # Seconds a clean stop (after the drain) waits for the disk tier to write the entries still in memory; what is
    # not written by then is lost (no partial file stays). A 20k-token prompt of an 8B model is about 3 GB: give it
    # time. `mlxd service` adds it to the unit's stop timeout.
    prefix_cache_persist_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0
    # Vision-language models: bytes of image features (vision-tower outputs) kept by image digest, so that an image
    # re-sent in a later turn costs no vision-tower run; 0 turns it off.
    vision_feature_cache_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 512 * 1024**2
    # Vision-language models: encode images on a thread of their own while the engine steps (the requests waiting
    # for them are admitted once their features are in), instead of inside the step that starts their prompts.
    # Text requests then never wait for other requests' images, for 11-17% of a mixed workload's throughput on the
    # CPU and 2-6% on an H100 (docs/benchmarks/vision.md). Needs the feature cache; not in a distributed group.
    vision_encoder_thread: bool = False
    # A request that waits in the queue longer than this gets 503 instead of waiting forever (0: no limit).
    max_queue_wait_s: Annotated[float, msgspec.Meta(ge=0, le=DAY_S)] = 300.0
    # Memory admission: the KV cache a request can grow to (prompt + max_tokens) is counted against this, less the
    # weights and the prefix cache (which gives way first). 0: the device's recommended working set on Metal/CUDA,
    # a share of RAM on the CPU.
    memory_limit_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**50)] = 0
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        if self.kv_bits is not None and self.max_kv_size:
            raise ValueError(f"kv_bits = {self.kv_bits} cannot be used with max_kv_size = {self.max_kv_size}: "
                             "mlx-lm's rotating KV cache has no quantized form; unset one of them")


class VisionConfig(Base):
    """Image inputs of vision-language models (``mlxd.media``): where images may come from and how large."""

    # http(s) image URLs are refused unless this is true. Every address a host resolves to must be public (no
    # loopback, private, link-local or cloud-metadata address), redirects included.
    allow_remote: bool = False
    # Seconds for a whole remote fetch: name resolution, connecting, redirects and the body (no "0: no limit").
    remote_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0
    # Encoded bytes per image, for data: URIs, remote and local files alike.
    max_image_bytes: Annotated[int, msgspec.Meta(ge=0, le=1024**3)] = 20 * 1024**2
    # file:// URLs and absolute paths are refused unless they lie under this folder (symlinks and `..`
    # resolved; relative to the config's folder). Empty: no local files.
    local_dir: str = ""
    # Images per request; 0 refuses all images.
    max_images: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 8
    # Pixels per image: a larger image is downscaled to at most this many, aspect ratio kept (never refused for
    # being merely large). The default is above the own limits of common VLM processors (Qwen2-VL: 12.8M).
    max_pixels: Annotated[int, msgspec.Meta(ge=1, le=1024**3 // 12)] = 4096 * 4096
    # Pixels decoded for one image (a JPEG counts at the reduced scale it decodes at): an image declaring more in
    # its header is refused (400 naming its part) before any pixel is decoded.
    max_decode_pixels: Annotated[int, msgspec.Meta(ge=1, le=1024**3 // 12)] = 6144 * 6144
    # Pixels decoded for all the images of one request together, counted the same way.
    max_request_pixels: Annotated[int, msgspec.Meta(ge=1, le=1024**3)] = 128 * 1024 * 1024
    # Square images (pixels a side) sent through the whole pipeline once each before /health turns 200, so that
    # the first user images of these sizes do not pay for the shapes MLX builds on first use (mlxd.pipeline.
    # image_warmup). Each costs a second or more of start-up; [] sends none.
    warm_up_image_sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=16, le=4096)]],
                                   msgspec.Meta(max_length=8)] = msgspec.field(default_factory=lambda: [224])


class LoggingConfig(Base):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": a console renderer on a terminal, JSON lines otherwise (launchd, systemd).
    format: Literal["auto", "json", "console"] = "auto"


class DistributedConfig(Base):
    """One model over several processes, machines or GPUs (``mlx.core.distributed``), tensor-parallel: every rank
    holds a shard of each layer; rank 0 serves HTTP and schedules, the others run what it broadcasts
    (:mod:`mlxd.engine.distributed`). ``mlxd launch --config FILE`` starts every rank through ``mlx.launch``."""

    # MLX's backend: "ring" (TCP, Thunderbolt), "jaccl" (RDMA), "mpi", "nccl" (CUDA GPUs), "any" (MLX picks).
    backend: Literal["ring", "jaccl", "mpi", "nccl", "any"] = "any"
    # One entry per rank for `mlxd launch` (mlx.launch --hosts): IP addresses for ring; empty with no hostfile:
    # `tensor_parallel` processes on this machine.
    hosts: list[str] = []
    # Or a hostfile in the format mlx.launch reads (relative to the config's folder).
    hostfile: str = ""
    # ring: the first TCP port (mlx.launch --starting-port, one more per rank); 0: mlx.launch's default (32323).
    starting_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    # Ranks sharing each layer: the group's size, checked at start-up.
    tensor_parallel: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 2
    # Rank 0's watchdog: a step (a collective with a peer that died can block forever) that runs longer than
    # this ends every request with an error and the process, non-zero.
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=DAY_S)] = 60.0
    # While idle, rank 0 pings the group this often, so that a lost rank is noticed without traffic.
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    # Rank 0's control port (TCP, every interface), which the other ranks connect to once after warm-up for rank
    # 0's messages; 0: an ephemeral port, announced through the group. Set one where a firewall sits between hosts.
    control_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0


class PipelineSpec(Base):
    """Inline stages: each a table with ``type`` plus that stage's options, validated by the stage itself."""

    stages: list[dict[str, Any]]


class ServedModelConfig(ModelConfig):
    """One of several models (``[models.NAME]``): what ``[model]`` holds, plus its own engine and pipeline and when
    it is loaded. NAME is the served name unless ``name`` says otherwise."""

    # Replaces the top-level [engine] table for this model (whole, not field by field); absent: [engine].
    engine: EngineConfig | None = None
    # As the top-level `pipeline`; absent: the top-level one.
    pipeline: str | PipelineSpec | None = None
    # "at_start": before /health turns 200; "on_request": on its first request (which waits). "default": the first
    # model at start, the others on request.
    load: Literal["default", "at_start", "on_request"] = "default"
    # Unloaded after this many seconds without requests (0: never).
    idle_unload_s: Annotated[float, msgspec.Meta(ge=0, le=DAY_S)] = 0.0
    # Never unloaded (neither when idle nor to make room for another model).
    pin: bool = False


class DaemonConfig(Base):
    # One model ([model]) or several ([models.NAME] tables), not both; mlxd.config.models reads either as a list.
    # With [models.*] alone, `model` is the first of them once loaded (mlxd.config.load).
    model: ModelConfig | None = None
    models: dict[str, ServedModelConfig] = {}
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    logging: LoggingConfig = LoggingConfig()
    vision: VisionConfig = VisionConfig()
    # Absent: one process. Present: a tensor-parallel group (mlxd/engine/distributed.py).
    distributed: DistributedConfig | None = None
    # A pipeline name (pipelines/NAME.toml beside the config, else the built-in mlxd/pipelines/NAME.toml), a path
    # to a pipeline TOML file, or inline [[pipeline.stages]].
    pipeline: str | PipelineSpec = "chat"
