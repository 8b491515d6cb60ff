"""params.yaml's schema: one frozen dataclass per section, each field with its type, default and a
comment saying what it does. The comments are the reference: docs/params.md is generated from
them (python -m pipeline.core.params_doc). Loading and validation: pipeline/core/params.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from pipeline.core.fleet_params import FleetParams

VARIANTS = ("eager", "torchscript", "fp16", "bf16", "onnx", "onnx-fp16", "aoti",
            "onnx-int8-dynamic", "onnx-int8-static", "int8")
INT8_VARIANTS = ("onnx-int8-dynamic", "onnx-int8-static", "int8")   # dtype int8: conversion.tolerances.int8
TEXT_TASKS = ("text-embedding", "text-classification", "rerank", "token-classification")   # an hf folder + tokenizer.json
TASKS = TEXT_TASKS + ("image-classification", "tensor")
SOURCES = ("hf", "state_dict", "torchscript")
PKG_PREFIX = "pkg:"


# --------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class TextParams:
    """Text tasks: how requests' texts are tokenized and how many one request may carry."""
    max_length: int = 128          # tokens per text, at most the folder's own limit; shorter rows padded to the batch's
                                   # longest. Longer: text-embedding answers 413 unless the request sends
                                   # "truncate": true (TEI), token-classification 413, the others truncate
    max_texts: int = 64            # texts (rows) one request may carry: a rerank query's candidates, a list to embed


@dataclass(frozen=True)
class ImageParams:
    """How a request's image becomes the model's input, with the semantics of transformers' image
    processors (handlers/tasks/image.py): resize, centre crop, rescale, normalize per RGB channel.
    An hf folder's preprocessor_config.json says it instead: the seven preprocessing keys then stay unset."""
    size: Optional[int | list[int]] = None     # resize to exactly size x size, or [height, width] (aspect not kept);
                                               # 224 when neither this, resize_shortest_edge nor crop_size is set
    resize_shortest_edge: Optional[int] = None  # or: the shorter side to this, aspect kept (needs crop_size)
    crop_size: Optional[int | list[int]] = None  # centre crop after the resize: N x N or [height, width]
    resample: Optional[Literal["nearest", "lanczos", "bilinear", "bicubic", "box", "hamming"]] = None   # bilinear
    rescale_factor: Optional[float] = None     # pixels (0..255) x this first, e.g. 0.00392156862745098 (1/255); null: x 1
    mean: Optional[float | list[float]] = None  # input = (pixel - mean) / std, per channel [R, G, B] or one number; null: 127
    std: Optional[float | list[float]] = None   # see mean; null: 128 (pixels on the 0..255 scale)
    top_k: int = 5                             # labels per answer unless the request says (parameters.top_k)
    labels: Optional[str] = None   # JSON list of class names (pkg:/relative/absolute); hf: config.json id2label; else LABEL_<i>
    function_to_apply: Optional[Literal["softmax", "sigmoid", "none"]] = None   # null: as transformers chooses
    max_pixels: int = 50_000_000               # a larger image is refused (413) before it is decoded


@dataclass(frozen=True)
class ModelParams:
    """The checkpoint and what it computes."""
    name: str                                  # the served model's name: <name>.mar, /predictions/<name>
    # hf: a Hugging Face folder (config.json, weights, tokenizer); state_dict: a weights file + model.factory;
    # torchscript: a torch.jit.save file
    source: Literal["hf", "state_dict", "torchscript"]
    # the checkpoint: a path relative to the repo root, an absolute path, or pkg:<package>/<path> inside an
    # installed package; its files are a DVC dependency (artifacts/checkpoint.json)
    checkpoint: str
    # text-embedding / text-classification / rerank / token-classification need source hf
    task: Literal["text-embedding", "text-classification", "rerank", "token-classification",
                  "image-classification", "tensor"]
    factory: Optional[str] = None              # "pkg.module:fn" or "path/to/file.py:fn"; state_dict only
    factory_kwargs: dict = field(default_factory=dict)   # keyword arguments of model.factory
    input_shape: Optional[list[int]] = None    # tensor task: one sample, batch dim excluded
    trust_checkpoint: bool = False             # allow full pickle (runs code from the file!)
    text: TextParams = field(default_factory=TextParams)
    image: ImageParams = field(default_factory=ImageParams)


@dataclass(frozen=True)
class Tolerance:
    atol: float                                # absolute tolerance per element
    rtol: float                                # relative tolerance per element (x |reference|)
    min_cosine: float                          # every sample's cosine to the reference at least this
    # gate 'elementwise' (the float dtypes): every element within atol + rtol*|ref|, every sample's
    # cosine >= min_cosine. gate 'task' (int8): judged in the task's language (pipeline/accuracy/task_gate.py):
    # text-embedding: per-sample cosine >= min_cosine AND recall@k of the reference's nearest
    # neighbours >= min_recall_at_k; image-classification: top-1 agreement >= min_top1_agreement AND
    # mean top-k overlap >= min_topk_overlap; tensor: atol/rtol/cosine as 'elementwise'.
    gate: Literal["elementwise", "task"] = "elementwise"
    min_recall_at_k: float = 0.95              # text-embedding, gate task: recall@k of the reference's nearest neighbours
    recall_k: int = 10                         # k = min(recall_k, (samples - 1) // 4): small golden sets get a smaller k
    min_top1_agreement: float = 0.97           # classification, gate task: share of samples with the reference's top-1
    min_topk_overlap: float = 0.8              # ...and mean overlap of the top-k labels
    topk: int = 5                              # ...with this k
    min_ndcg: float = 0.95                     # rerank: NDCG@10 of the variant's order vs eager's (task_gate_text)
    min_entity_f1: float = 0.95                # token-classification: entity F1 vs eager's, exact span + type


def _default_tolerances() -> dict:
    return {
        "float32": Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.99999),
        "float16": Tolerance(atol=2e-2, rtol=5e-2, min_cosine=0.999),
        "bfloat16": Tolerance(atol=8e-2, rtol=1e-1, min_cosine=0.995),
        "int8": Tolerance(atol=5e-2, rtol=1e-1, min_cosine=0.995, gate="task"),
    }


@dataclass(frozen=True)
class Int8Params:
    """The int8 variants: calibration and the sensitivity fallback."""
    calibration: Literal["minmax", "entropy", "percentile"] = "minmax"   # onnx-int8-static's range method
    calibration_samples: int = 64              # representative requests (task's example distribution, own seed)
    per_channel: bool = True                   # per-output-channel weight scales
    # 7-bit weights, so AVX2's u8s8 kernels (no VNNI) cannot saturate; auto: on such hosts only (env.json)
    reduce_range: bool | Literal["auto"] = "auto"
    # ONNX int8: move activation outliers into the weights first (pipeline/build/variants/int8/smoothing.py);
    # auto: the α in (0.5, 0.6, 0.7, 0.8) whose worst op errs least, or none; a number: that α; null: off
    smoothing_alpha: float | Literal["auto"] | None = "auto"
    sensitivity_budget_s: float = 120.0        # time for the per-layer sensitivity fallback (one budget over all build methods)
    max_fp32_share: float = 0.5                # keep at most this share of the quantizable ops in fp32


@dataclass(frozen=True)
class ConversionParams:
    """Building the variants and checking each against eager's outputs."""
    timeout_s: int = 900                       # per variant, its own process
    onnx_opset: int = 18                       # the ONNX opset the ONNX variants are exported with
    # ONNX variants of a model with at least this many MB of fp32 weights keep them in model.onnx.data:
    # required from 2 GB (protobuf), and faster to load well before (mapped, not parsed; docs/big-models.md).
    onnx_external_data_mb: float = 256.0
    # CPU ONNX variants with external data ship ORT's pre-packed weight layout for this host (mapped at load,
    # so no session re-lays the MatMul weights out); the data file grows by the packed bytes.
    onnx_prepack: bool = True
    # Attention fused (MultiHeadAttention) on the exported graph before ORT optimises it, kept only when its
    # outputs equal the export's (pipeline/build/variants/fusion.py): fewer nodes, a faster session setup.
    onnx_fusions: bool = True
    tolerances: dict[str, Tolerance] = field(default_factory=_default_tolerances)   # per dtype (float32, float16, bfloat16, int8)
    min_topk_agreement: float = 0.99           # classification: share of samples whose top-1 matches
    golden_seed: int = 0                       # the golden inputs are generated from this seed
    golden_batches: int = 3                    # distinct batches per verified batch size
    screen: bool = True                        # screen each variant's batch-1 call against eager's (pipeline/build/plan.py)
    screen_max_slowdown: float = 4.0           # ...and skip it when that call is more than this many times slower
    big_model_mb: float = 500.0                # from this model size on, verify one golden batch per batch size
    int8: Int8Params = field(default_factory=Int8Params)


@dataclass(frozen=True)
class BenchmarkParams:
    """Measuring every variant on the target device: cold loads in fresh processes, latency and throughput per batch size."""
    device: Literal["auto", "cpu", "cuda"] = "auto"   # where to measure and serve; auto: the GPU when there is one
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])   # the sizes measured, increasing
    threads: int = 0                           # intra-op threads; 0 → what one serving worker gets
    cold_runs: int = 5                         # fresh processes per variant (at least steady_runs)
    # Steady state is measured in this many of those processes, spread over the benchmark: a figure
    # from one process carries that process's luck (memory placement, allocator, host load). Five
    # short rounds rather than three longer ones: on a shared host the rounds disagree far more than
    # the calls inside one do, so for the same measuring time more rounds give a steadier figure.
    steady_runs: int = 5
    # Per variant, the start from disk included (0: no limit): no optional fresh process starts once it
    # would pass this many seconds; the 2 required rounds (their processes the 2 cold loads) always run,
    # the second measuring for what is left (pipeline/measure/runner.py ProcessBudget), so a GB-sized
    # model does not spend minutes on rounds a small one gets.
    budget_s: float = 40.0
    # ...and no further steady round once every size's round p50s agree within this (0: never stop
    # early): another round would move the figures less than the tie band selection applies anyway.
    rounds_agree_within: float = 0.03
    # Later rounds visit their sizes round-robin in this many short windows, so every size's samples
    # span the round: host noise that comes and goes over seconds weighs on all sizes alike.
    interleave_passes: int = 4
    warmup_iters: int = 5                      # per batch size and round...
    warmup_max_s: float = 1.0                  # ...cut short after this (at least 2 calls)
    min_iters: int = 6                         # per batch size and round: BOTH this many calls...
    min_duration_s: float = 0.3                # ...AND this long;
    point_max_s: float = 2.0                   # or this long with at least 3 calls (0: no cap): a big model's
                                               # second-long calls would otherwise take min_iters x that
    max_cv: float = 0.15                       # re-measure once above this, then flag as noisy; also
                                               # flags a point whose rounds' p50s spread more than this
    min_gain: float = 0.05                     # stop the sweep when throughput gains fall under this...
    sweep_patience: int = 2                    # ...for this many sizes in a row (one noisy point can't end it)
    # Stop the sweep after the first batch whose p99 passes this (measured once, not re-measured): it
    # only shows where the curve leaves the usable range. Its own key, not serve.*: a new SLO never
    # re-runs the benchmarks; params check serve.latency_slo_ms <= this, so every batch the SLO
    # could serve is measured. 400 ms, twice the default SLO: a 2 GB model's batches of 0.8-1.6 s
    # cost ~10-20 s a variant and serve nothing.
    latency_cap_ms: float = 400.0
    # Tokens per sample for text benchmarks: a batch is padded to its longest text, so this is the
    # padded length of a typical batch. 24 ≈ batches of 5–15-word sentences (the serve-check load).
    text_length: int = 24
    tensorrt: bool = False                     # ONNX on GPU: try the TensorRT EP first
    # One more cold start per variant with the artifact dropped from the page cache first: the load a
    # fresh host pays, against the disk read of the same bytes (the page-cache runs price it against
    # a memory copy). Costs one cold load per variant.
    from_disk: bool = True
    # A variant that is not exact (quantized, or one that changes the task's answers) cannot win unless
    # serve.allow_quantized is true. brief: it gets the 2 required rounds and no start from disk, its
    # figures showing what opting in would give (pipeline/measure/effort.py); full: measured as every
    # other variant (needed with serve.allow_quantized: true, where it may win).
    inexact: Literal["brief", "full"] = "brief"


@dataclass(frozen=True)
class ServeOverrides:
    """Replace a setting the pipeline derives (artifacts/serve/derivation.json names them); null: derived."""
    batch_size: Optional[int] = None           # TorchServe's batchSize: requests
    batch_rows: Optional[int] = None           # rows per model call (a rerank request is many rows)
    max_batch_delay_ms: Optional[int] = None   # TorchServe's maxBatchDelay: how long a batch waits to fill
    workers: Optional[int] = None              # worker processes (minWorkers = maxWorkers)
    threads_per_worker: Optional[int] = None   # intra-op threads of each worker
    startup_timeout_s: Optional[int] = None    # startupTimeout: a worker not READY by then is killed
    response_timeout_s: Optional[int] = None   # responseTimeout: a batch not answered by then fails
    job_queue_size: Optional[int] = None       # requests queued before TorchServe answers 503
    max_request_size: Optional[int] = None     # bytes of one request body
    max_response_size: Optional[int] = None    # bytes of one response body
    store_form: Optional[Literal["mar", "folder"]] = None     # how the model sits in the model store


@dataclass(frozen=True)
class ServeParams:
    """The constraints the winner is chosen under and how its TorchServe configuration is derived."""
    latency_slo_ms: float = 200.0              # p99 per request, batching delay included
    objective: Literal["throughput", "latency", "cold_load"] = "throughput"   # what the winner maximises / minimises
    require_slo: bool = False                  # true: fail the build when no variant meets the SLO and the budgets
    # Exact by default: an int8 variant (its answers move beyond the float tolerances) is served only
    # when the user accepts it; otherwise the decision shows what it would give and this opt-in line.
    allow_quantized: bool = False
    memory_budget_mb: float = 4096.0           # per worker
    max_cold_load_s: Optional[float] = None    # a variant whose worst cold load passes this is not chosen; null: no limit
    # Disk the deployment host reads the artifact from; null: the read speed measured here (page cache).
    # A slower disk adds artifact MB / this to startupTimeout (the report shows 200 MB/s either way).
    target_disk_read_mb_s: Optional[float] = None
    # Artifacts at least this big are served from an unpacked folder in the model store instead of the
    # .mar TorchServe copies out of its archive at every start (the .mar is published either way).
    folder_store_min_mb: float = 500.0
    platform: Literal["linux", "windows"] = "linux"    # the deployment host's OS (paths and the start command)
    bind_address: str = "127.0.0.1"            # every TorchServe listener binds here (loopback unless you open it)
    model_store: Optional[str] = None          # path on the deployment host; None → artifacts/model_store
    startup_safety: float = 3.0                # startupTimeout = max(floor, worst cold load x this + margin [+ disk read])
    startup_margin_s: float = 10.0             # ...the margin added
    startup_floor_s: int = 30                  # ...and its floor
    response_safety: float = 5.0               # responseTimeout = max(floor, (p99 of a batch x this + maxBatchDelay))
    response_floor_s: int = 5                  # ...and its floor
    expected_concurrency: int = 16             # requests in flight in production: batchSize <= this // workers
    min_batch_gain: float = 0.05               # a bigger batch must add this much throughput (or more than the noise)
    noise_floor: float = 0.03                  # smallest relative difference ever treated as real (ties below)
    delay_headroom_share: float = 0.5          # maxBatchDelay uses at most this share of the SLO headroom
    worker_import_s: float = 1.3               # TorchServe's own worker imports torch before any handler code
    memory_share: float = 0.8                  # share of host / GPU memory the workers may fill together
    max_workers_per_gpu: int = 2               # more processes per GPU only time-slice the same device
    inference_port: int = 8080                 # the deployed server's ports (the checks here use free ports)
    management_port: int = 8081                # ...management API
    metrics_port: int = 8082                   # ...metrics API
    overrides: ServeOverrides = field(default_factory=ServeOverrides)


@dataclass(frozen=True)
class TuneParams:
    """The tune stage (pipeline/serve/tune/tuning.py): candidates served in a real TorchServe under the expected load."""
    enabled: bool = True                       # false: the offline choice is served untested (verdict: predicted)
    rounds: int = 2                            # every candidate served this many times, interleaved
    max_rounds: int = 4                        # a comparison still undecided (better, within noise) gets more, up to this
    measure_s: float = 2.0                     # seconds of load per candidate and round (after a warm-up)
    warmup_requests: int = 32                  # per server start, not measured
    max_candidates: int = 5                    # offline choice + larger batches + the other workers × threads layout
    contenders: int = 3                        # variants tied offline (within noise) served against each other; 1: off
    frontend: bool = True                      # also try disable_system_metrics and netty thread counts


@dataclass(frozen=True)
class ServeCheckParams:
    """The proof in a real TorchServe: parity, bad input, and the winner against the hand-tuned and naive setups under load."""
    requests: int = 3000                       # measured requests per setup and round (after the warm-up)...
    # keep-alive clients of the measured load; null: serve.expected_concurrency, the load tune chose for
    concurrency: Optional[int] = None
    # ...or no new request after this many seconds: the naive baseline of a GB-sized model answers a
    # few requests a second, and a capped window gives its rate as well as all of them.
    time_cap_s: float = 10.0
    # The same load before the measured one, on every server start, in 1-s windows until two agree
    # within 5% or this many seconds have passed: a fresh TorchServe answers its first thousands of
    # requests at a fraction of its rate (JIT of the frontend).
    warmup_s: float = 10.0
    # The references stage serves these once per host, model, load and recipe (metrics/references.json):
    baseline: bool = True                      # the naive baseline (default handler, fp32 eager, batch 1)
    handtuned: bool = True                     # the hand-tuned ONNX reference (pipeline/serve/reference/handtuned.py)
    rounds: int = 2                            # the references' interleaved rounds; the winner's with the ceilings...
    # ...served again only while a comparison is undecided: throughput, p99 or READY within this
    # share of parity (0: every round for every setup)
    decided_band: float = 0.25
    # Task rerank only (issue 26): a load of this many texts per query from this many keep-alive
    # clients against the winner, its rows/s against the model's own offline rows/s at the batches
    # the server formed (metrics/serve_check.json `rerank_load`; pipeline/serve/checks/rerank_load.py).
    rerank_texts: int = 20
    rerank_clients: int = 4                    # see rerank_texts


@dataclass(frozen=True)
class PublishParams:
    """Where the built artifacts go."""
    kserve_storage_uri: Optional[str] = None   # storageUri written into artifacts/kserve/inferenceservice.yaml; None → placeholder


@dataclass(frozen=True)
class Params:
    model: ModelParams
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))   # the conversions built and compared; eager is the reference
    # The servers serve_check proves the winner in, under the same checks and load: torchserve (the .mar), and
    # ray-serve beside it (artifacts/ray-serve/, written on every run either way; docs/ray-serve.md).
    servers: list[str] = field(default_factory=lambda: ["torchserve"])
    conversion: ConversionParams = field(default_factory=ConversionParams)
    benchmark: BenchmarkParams = field(default_factory=BenchmarkParams)
    serve: ServeParams = field(default_factory=ServeParams)
    tune: TuneParams = field(default_factory=TuneParams)
    serve_check: ServeCheckParams = field(default_factory=ServeCheckParams)
    publish: PublishParams = field(default_factory=PublishParams)
    fleet: FleetParams = field(default_factory=FleetParams)     # make fleet (pipeline/core/fleet_params.py)
