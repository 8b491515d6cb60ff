"""The converter registry: one class per deployment variant, registered by name (Olive-style passes).

A converter declares its own options (an `Options` dataclass built from params by `from_params`),
the runtime family/format/dtype of what it builds, and one or more build `methods` in order of
preference (e.g. a frozen TorchScript first, the plain trace if freezing does not verify). Each
method writes ONE artifact into the variant folder and returns an `Artifact` describing it; building
the folder around it (variant.json, extra files) and verifying it is `pipeline.build.builder`'s job.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from pipeline.core.params import Params

REGISTRY: dict[str, type["Converter"]] = {}


@dataclass
class BuildContext:
    """Everything a build method may use. `device` is the resolved target ('cpu' | 'cuda')."""
    loaded: Any                    # pipeline.model.checkpoint.LoadedModel
    golden: Any                    # pipeline.model.golden.Golden
    out_dir: Path
    device: str

    def module(self):
        """The torch module to build from, loaded again if an earlier step released it."""
        return self.loaded.require_module()

    def example_feeds(self, batch_size: int | None = None) -> dict[str, np.ndarray]:
        """A golden batch's feeds: of `batch_size`, or the largest batch when None (tracing with a
        batch > 1 keeps torch.export from specialising the batch dimension to 1)."""
        batches = self.golden.batches
        if batch_size is None:
            return max(batches, key=lambda b: b.batch_size).feeds
        for b in batches:
            if b.batch_size == batch_size:
                return b.feeds
        raise ValueError(f"the golden set has no batch of size {batch_size} "
                         f"(sizes: {sorted({b.batch_size for b in batches})}); re-run `python -m stages.prepare`")

    def example_inputs(self, batch_size: int | None = None, device: str = "cpu", float_dtype=None) -> tuple:
        import torch
        feeds = self.example_feeds(batch_size)
        args = []
        for spec in self.loaded.inputs:
            t = torch.as_tensor(feeds[spec.name]).to(device)
            if float_dtype is not None and t.is_floating_point():
                t = t.to(float_dtype)
            args.append(t)
        return tuple(args)

    def dynamic_shapes(self) -> tuple:
        """torch.export dynamic shapes from the inputs' dynamic axes. Dim.DYNAMIC raises when tracing
        specialises an axis (e.g. a Python int taken from the batch size) instead of hiding it."""
        import torch
        return tuple({int(axis): torch.export.Dim.DYNAMIC for axis in spec.dynamic_axes}
                     for spec in self.loaded.inputs)


@dataclass
class Artifact:
    """What one build method wrote."""
    file: str                                   # name inside the variant folder
    format: str                                 # runtime format: eager | torchscript | aoti | onnx
    input_dtypes: dict[str, str]                # what the artifact takes, per input
    extra: dict = field(default_factory=dict)   # more variant.json fields (e.g. graph_optimized)
    data_files: list[str] = field(default_factory=list)   # files the artifact needs beside it (ONNX external data)

    @property
    def files(self) -> list[str]:
        return [self.file, *self.data_files]


class Converter:
    name: ClassVar[str]
    family: ClassVar[str]                       # torch | onnx
    dtype: ClassVar[str] = "float32"            # compute dtype; selects the tolerance
    methods: ClassVar[tuple[str, ...]]          # build methods, most preferred first
    # Whether a method whose artifact verification REJECTED is followed by the next method (one that
    # FAILED to build always is). True where the methods compute differently (a frozen trace vs a
    # plain one); False where they only reach the same computation another way.
    retry_rejected: ClassVar[bool] = True
    # True where the build itself drops the torch module (LoadedModel.release_module; every build's
    # verification does too): the plan's screen then times eager's calls before the build instead of
    # alternating them with the variant's.
    releases_module: ClassVar[bool] = False

    @dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options: "Converter.Options | None" = None):
        self.options = options if options is not None else self.Options()

    @classmethod
    def from_params(cls, params: Params) -> "Converter":
        return cls(cls.Options())

    def options_dict(self) -> dict:
        return dataclasses.asdict(self.options)

    def for_host(self, env: dict) -> "Converter":
        """This converter with its host-dependent options ("auto") decided for the host `env`
        describes (artifacts/env.json). Most options do not depend on the host: itself."""
        return self

    @classmethod
    def host_unsuitable(cls, env: dict) -> Optional[str]:
        """Why this variant is not worth building on the host `env` describes (artifacts/env.json:
        device, cpu.isa flags), or None. Variants whose speed depends on instructions override it."""
        return None

    def build(self, method: str, ctx: BuildContext) -> Artifact:
        fn = getattr(self, "build_" + method.replace("-", "_").replace("+", "_"), None)
        if fn is None:
            raise ValueError(f"{type(self).__name__} has no build method {method!r}")
        return fn(ctx)


def register(cls: type[Converter]) -> type[Converter]:
    if cls.name in REGISTRY:
        raise ValueError(f"variant {cls.name!r} registered twice ({REGISTRY[cls.name].__name__}, {cls.__name__})")
    REGISTRY[cls.name] = cls
    return cls


def get_converter(name: str) -> type[Converter]:
    import pipeline.build.variants  # noqa: F401  (registers every variant module)
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no converter registered for variant {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def default_input_dtypes(loaded, float_dtype: str = "float32") -> dict[str, str]:
    """Artifact input dtypes: integer inputs unchanged, floating inputs in `float_dtype`."""
    return {s.name: (float_dtype if s.dtype.startswith("float") else s.dtype) for s in loaded.inputs}


def module_copy(module, device: str = "cpu", dtype=None):
    """A copy of `module` on `device` (floating tensors in `dtype` when given) that converters may
    trace, export, freeze or restructure without touching the loaded model — without a second
    copy of its weights: a tensor already on that device and dtype is shared, not duplicated, and
    a converted one is made directly from the original (never an fp32 copy first). Tracing,
    torch.export and quantize_dynamic read weights, they do not write them; `copy.deepcopy(m).to(...)`
    would hold one more full copy at every conversion."""
    import copy

    import torch

    def converted(t: torch.Tensor) -> torch.Tensor:
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t if (t.device.type == torch.device(device).type and t.dtype == want) else \
            t.detach().to(device=device, dtype=want)

    memo = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(converted(p.data), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = converted(b)
    return copy.deepcopy(module, memo).eval()


def forget_jit_types() -> None:
    """Drop the TorchScript types this process compiled (call once the module is saved). The global
    class registry keeps every traced or scripted module's type, and through it its constants, for
    the life of the process: a frozen model's optimised weights would stay resident through the
    screen and verification, which load the saved artifact on top. Saved
    and loaded modules keep their own types; the next trace registers new ones. All three caches go
    together, as torch's own test helper (`clear_class_registry`) does: clearing the registry alone
    left the module-type cache pointing into it, and the next `torch.jit.script` crashed."""
    import torch
    try:
        clear_registry = torch._C._jit_clear_class_registry
        fresh_store = torch.jit._recursive.ConcreteTypeStore
        clear_classes = torch.jit._state._clear_class_state
    except AttributeError:
        return                        # another torch: its caches stay (memory only, never correctness)
    clear_registry()
    torch.jit._recursive.concrete_type_store = fresh_store()
    clear_classes()


def forget_last_export() -> None:
    """Let go of what torch.export and the ONNX exporter keep of the last model they traced (call once
    its program is saved or compiled). Both keep it in module-level state until the next export:
    - torch.export's map from fake tensors to graph nodes (`_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT`,
      cleared at the start of each trace), through the traced graph the module and its real weights;
    - onnxscript's rewrite-rule matchers, the graph and node they last looked at (`_graph`,
      `_current_node`, the match state, set at the start of each match), through them the exported
      model wrapping the module's weights.
    Through them the aoti and ONNX builds would hold the weights after releasing the module: a
    full copy beside the artifact the screen and verification load."""
    try:
        from torch.fx.experimental import proxy_tensor
        proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()
    except (ImportError, AttributeError):
        pass                          # another torch: nothing known to clear (memory only)
    import gc
    import sys
    if "onnxscript" not in sys.modules:
        return
    try:
        from onnxscript.rewriter import _basics, _matcher
    except ImportError:
        return
    for obj in gc.get_objects():
        if isinstance(obj, _matcher.SimplePatternMatcher):
            obj._current_node = obj._graph = obj._tracer = None
            obj._match = _basics.MatchResult()
