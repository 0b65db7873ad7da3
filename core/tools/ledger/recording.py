"""Recording one forward's op calls: the model's op objects (its backend, its kernel plan, the
functions it keeps) wrapped, each top-level call kept with its arguments and the kernels it
launched; and what each call moves and computes (bytes, FLOPs) for its roofline."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LARGE_ARRAY_BYTES = 1 << 30  # a pool (KV cache, state slots) is never read whole by one op
# backend methods that place data or sample rather than compute a layer
NOT_OPS = frozenset({"upload", "weight", "linear_weight", "prepare_batch", "static_batch", "allocate_kv",
                     "to_host", "synchronize", "kv_memory_budget", "sample_rows", "sample_rows_async",
                     "upload_token_ids", "fill_token_sources", "fp32_vector", "norm_weight", "forward",
                     "release_request", "load", "kv_cache_specs"})


# attention over the whole step from ``q``, each through its kernels (``mixed_attention``: the decode
# rows on the decode kernel, the chunks on the prefill kernel)
ATTENTION_KERNEL_CALLS = ("prefill_attention", "decode_attention", "short_query_attention", "mixed_attention")


@dataclass
class OpCall:
    owner: str  # "backend" or "plan"
    name: str
    fn: Any  # the unwrapped bound method
    args: tuple
    kwargs: dict
    result: Any
    kernels: list[str] = field(default_factory=list)


class OpRecorder:
    """Wraps the public methods of the model's op objects; records top-level calls while on.

    ``expand`` maps an op name to (module, function names): that op is recorded as the calls it
    makes to those module functions instead of as one call (cuda attention: the q/k-norm + RoPE +
    KV write, then the attention kernel, each its own ledger row)."""

    def __init__(self, owners: dict[str, Any], model: Any = None, kernel_names: bool = True,
                 expand: dict[str, tuple[Any, tuple[str, ...]]] | None = None):
        self.calls: list[OpCall] = []
        self.recording = False
        self._depth = 0
        self._current: OpCall | None = None
        self._patched: list[tuple[Any, str]] = []
        self._expanded = set(expand or {})
        for op_name, (module, functions) in (expand or {}).items():
            for function in functions:  # the op's module looks these up at call time
                setattr(module, function, self._wrap(op_name, function, getattr(module, function)))
        if model is not None:
            self._wrap_model(model)
        for owner_name, owner in owners.items():
            for name in dir(owner):
                if name.startswith("_") or name in NOT_OPS:
                    continue
                if isinstance(getattr(type(owner), name, None), property):
                    continue
                method = getattr(owner, name)
                if callable(method) and hasattr(method, "__self__"):
                    setattr(owner, name, self._wrap(owner_name, name, method))
                    self._patched.append((owner, name))
        if kernel_names:  # cuda: the kernels each op launches
            self._patch_kernel_loaders()

    def _wrap_model(self, model: Any) -> None:
        """A model's own op table: a frozen dataclass of functions (``model.plan``, replaced by a
        copy whose callables are wrapped) and functions it keeps as attributes (``model.rms_norm``)."""
        import dataclasses

        plan = getattr(model, "plan", None)
        if plan is not None and dataclasses.is_dataclass(plan):
            wrapped = {f.name: self._wrap("plan", f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan)
                       if callable(getattr(plan, f.name)) and f.name not in NOT_OPS}
            model.plan = dataclasses.replace(plan, **wrapped)
        for name, value in list(vars(model).items()):
            if name.startswith("_") or name in NOT_OPS or name == "plan" or not callable(value):
                continue
            if hasattr(value, "__self__") or type(value).__name__ == "function":
                setattr(model, name, self._wrap("model", name, value))

    def _wrap(self, owner: str, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not self.recording or self._depth:
                self._depth += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    self._depth -= 1
            # recorded through the calls it makes (at top level); only the backend's op of that name
            # (a model plan's own "attention", e.g. MLA, does not call the expanded functions)
            if owner == "backend" and name in self._expanded:
                return method(*args, **kwargs)
            call = OpCall(owner, name, method, args, kwargs, None)
            self._current = call
            self._depth += 1
            try:
                call.result = method(*args, **kwargs)
            finally:
                self._depth -= 1
                self._current = None
            self.calls.append(call)
            return call.result
        return recorded

    def _note_kernel(self, name: str) -> None:
        if self._current is not None and (not self._current.kernels or self._current.kernels[-1] != name):
            self._current.kernels.append(name)

    def _patch_kernel_loaders(self) -> None:
        """Kernel names per op: every launch goes through a loader called per launch."""
        from openinfer.backend.cuda import loader
        from openinfer.backend.cuda.cublas import Cublas

        original = loader._kernel

        def named(source: str, name: str, defines: tuple) -> Any:
            self._note_kernel(name)
            return original(source, name, defines)

        loader._kernel = named
        original_arch = loader._arch_kernel  # architecture-specific builds (the sm90 prefill attention)

        def named_arch(source: str, name: str, arch: str, defines: tuple, shared_bytes: int) -> Any:
            self._note_kernel(f"{name} ({arch})")
            return original_arch(source, name, arch, defines, shared_bytes)

        loader._arch_kernel = named_arch
        matmul = Cublas.matmul_nt

        def cublas(blas: Any, *args: Any, **kwargs: Any) -> Any:
            self._note_kernel("cublas_gemmEx_bf16")
            return matmul(blas, *args, **kwargs)

        Cublas.matmul_nt = cublas
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("openinfer_") and module_name.endswith("cuda_ops") and hasattr(module, "kernel"):
                plugin_kernel = module.kernel

                def plugin_named(name: str, *args: Any, _original: Any = plugin_kernel, **kwargs: Any) -> Any:
                    self._note_kernel(name)
                    return _original(name, *args, **kwargs)

                module.kernel = plugin_named

    def record(self, forward: Any) -> list[OpCall]:
        self.calls = []
        self.recording = True
        try:
            forward()
        finally:
            self.recording = False
        return self.calls


@functools.cache
def _array_types() -> tuple[type, ...]:
    """The array classes an op's arguments may hold: NumPy's, and CuPy's where it is installed."""
    try:
        import cupy
    except ImportError:
        return (np.ndarray,)
    return (np.ndarray, cupy.ndarray)


def _arrays(value: Any) -> list[Any]:
    if isinstance(value, _array_types()):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [a for name in value.__dataclass_fields__ for a in _arrays(getattr(value, name))]
    return []


def _linear_weight(layer: Any) -> tuple[int, int, int]:
    """(out features, in features, weight bytes) of a backend's linear layer (cuda: ``weight
    [out, in]``; numpy: ``weight_t [in, out]``; packed FP8 / INT4 ``data`` + ``scale``: the bytes
    as stored, which is what the GEMM reads)."""
    weight = getattr(layer, "weight", None)
    if weight is not None:
        return int(weight.shape[0]), int(weight.shape[1]), int(weight.nbytes)
    data = getattr(layer, "data", None)
    if data is not None:
        scale = getattr(layer, "scale", None)
        stored = int(data.nbytes) + (0 if scale is None else int(scale.nbytes))
        return int(layer.out_features), int(layer.in_features), stored
    return int(layer.out_features), int(layer.in_features), int(layer.weight_t.nbytes)


def _op_args(call: OpCall) -> tuple:
    """A call's arguments without a model plan's leading ``ops`` (the backend) argument: plan ops
    are ``(ops, x, ...)`` where backend ops are ``(x, ...)``."""
    args = call.args
    if call.owner == "plan" and args and not isinstance(args[0], _array_types()) and hasattr(args[0], "linear"):
        return args[1:]
    return args


def _sequence_shape(host: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's (new tokens, context length incl. them) as float arrays."""
    return np.diff(host.query_start).astype(np.float64), host.context_lens.astype(np.float64)


def mla_cost(args: tuple, host: Any) -> tuple[float, float]:
    """(bytes, FLOPs) of one MLA attention op ``(qkv_a, w, kv, batch, spec, rope, q_lora_rank,
    eps)``: q_b (when the model has a q LoRA), the per-head W_UK / W_UV, the context's latents
    read once, q in and the heads' output out. FLOPs per sequence take the cheaper of the two
    forms (absorbed: queries into the 576-wide latent space; decompressed: the context's keys and
    values expanded per head), the least any kernel must do."""
    qkv_a, w, kv, spec, q_lora_rank = args[0], args[1], args[2], args[4], args[6]
    tokens, heads = float(qkv_a.shape[0]), spec.num_heads
    lora, nope, rope_dim, v = spec.kv_lora_rank, spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim
    moved = float(qkv_a.nbytes) + tokens * heads * v * qkv_a.itemsize
    flops = 0.0
    if q_lora_rank:
        out_features, in_features, weight_bytes = _linear_weight(w.q_b)
        moved += weight_bytes
        flops += 2.0 * tokens * out_features * in_features
    moved += float(sum(a.nbytes for a in _arrays(w.mla)))
    query, context = _sequence_shape(host)
    moved += float(context.sum()) * spec.latent_dim * kv.k.itemsize
    pairs = query * (context - query) + query * (query + 1) / 2
    absorbed = 2.0 * query * heads * lora * (nope + v) + pairs * heads * 2.0 * (lora + rope_dim + lora)
    decompressed = 2.0 * context * lora * heads * (nope + v) + pairs * heads * 2.0 * (nope + rope_dim + v)
    return moved, flops + float(np.minimum(absorbed, decompressed).sum())


def moe_cost(args: tuple) -> tuple[float, float]:
    """(bytes, FLOPs) of one MoE layer op ``(h, MoEWeights, batch)``: the router, the routed
    experts the step's tokens reach (expected distinct experts of ``tokens x top_k`` uniform
    draws: random weights route about uniformly; a real model's skew only lowers it), the shared
    experts, the hidden rows in and out."""
    h, layer = args[0], args[1]
    tokens = float(h.shape[0])
    experts, top_k = layer.router.num_experts, layer.router.top_k
    expert = next(e for e in layer.experts if e is not None)
    up_out, hidden, up_bytes = _linear_weight(expert.gate_up)
    _, inner, down_bytes = _linear_weight(expert.down)
    reached = experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    moved = reached * (up_bytes + down_bytes) + float(np.asarray(layer.gate).nbytes) + 2.0 * h.nbytes
    flops = 2.0 * tokens * (experts * hidden + top_k * (up_out * hidden + hidden * inner))
    if layer.shared is not None:
        shared_out, _, shared_up = _linear_weight(layer.shared.gate_up)
        _, shared_inner, shared_down = _linear_weight(layer.shared.down)
        moved += shared_up + shared_down
        flops += 2.0 * tokens * (shared_out * hidden + hidden * shared_inner)
    else:  # fused shared experts (OPENINFER_MOE_SHARED_FUSED): the last S experts of the device stacks
        fused = int(getattr(getattr(layer, "stacked", None), "shared_experts", 0) or 0)
        moved += fused * (up_bytes + down_bytes)
        flops += 2.0 * tokens * fused * (up_out * hidden + hidden * inner)
    return moved, flops


def shape_of(value: Any) -> str:
    if isinstance(value, _array_types()):
        return "x".join(map(str, value.shape))
    if hasattr(value, "weight") and isinstance(value.weight, _array_types()):
        return "W" + "x".join(map(str, value.weight.shape))
    if hasattr(value, "weight_t") and isinstance(value.weight_t, _array_types()):
        return f"W{value.out_features}x{value.in_features}"
    if hasattr(value, "data") and hasattr(value, "out_features"):  # packed FP8 / INT4 (or stacked experts)
        return f"W{value.out_features}x{value.in_features}"
    return ""


def op_cost(call: OpCall, host: Any) -> tuple[float, float]:
    """(bytes moved at least, FLOPs) of one op call; ``host`` is the step's ForwardBatch."""
    args = _op_args(call)
    if call.name == "attention" and len(args) >= 7 and hasattr(args[4], "kv_lora_rank"):  # MLA (a plan op)
        return mla_cost(args, host)
    if call.name == "moe" and len(args) >= 2 and hasattr(args[1], "router"):
        return moe_cost(args)
    if call.name in ("linear", "add_rms_norm_linear", "silu_mul_linear"):  # the fused ones end in a linear
        x, layer = args[0], args[-1]
        m = x.shape[0]
        n, k, weight_bytes = _linear_weight(layer)
        extra = 0 if call.name == "linear" else (m * k if call.name == "silu_mul_linear" else 2 * m * k)
        return float(x.itemsize * (m * k + m * n + extra) + weight_bytes), 2.0 * m * n * k
    if call.name == "write_qkv":  # (qkv, spec, kv, batch, ropes): q/k norm + RoPE to q, K/V into the cache
        qkv, spec = args[0], args[1]
        tokens = qkv.shape[0]
        return float(qkv.nbytes + tokens * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * 2), 0.0
    if call.name in ATTENTION_KERNEL_CALLS:  # (q, spec, kv, batch, ...): every row of the step
        q, spec = args[0], args[1]
        query, context = _sequence_shape(host)
        pairs = float(np.sum(query * (context - query) + query * (query + 1) / 2))
        kv_token = 2 * spec.num_kv_heads * spec.head_dim * 2
        return float(2 * q.nbytes) + float(context.sum()) * kv_token, 4.0 * spec.num_heads * spec.head_dim * pairs
    if call.name == "attention":
        qkv, spec = args[0], args[1]
        tokens = qkv.shape[0]
        kv_token = 2 * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
        query, context = _sequence_shape(host)
        # each query attends to its causal prefix: sum over queries of (context - query + i + 1)
        pairs = float(np.sum(query * (context - query) + query * (query + 1) / 2))
        flops = 4.0 * spec.num_heads * spec.head_dim * pairs
        io = qkv.nbytes + tokens * spec.num_heads * spec.head_dim * 2 + tokens * kv_token
        return io + float(context.sum()) * kv_token, flops
    if call.name == "delta_net" and len(args) >= 4:  # (proj, weights, conv_state, ssm_state, seqs, config)
        proj, conv, ssm = args[0], args[2], args[3]
        per_seq = conv.nbytes / max(1, conv.shape[0]) + ssm.nbytes / max(1, ssm.shape[0])
        # the step's projections in, the core out, each sequence's state read and written
        return float(proj.nbytes + sum(a.nbytes for a in _arrays(call.result)) + 2 * per_seq * host.num_seqs), 0.0
    moved = sum(a.nbytes for a in _arrays((call.args, call.kwargs)) if a.nbytes < LARGE_ARRAY_BYTES)
    moved += sum(a.nbytes for a in _arrays(call.result))
    return float(moved), 0.0


def op_key(call: OpCall) -> str:
    shapes = [s for s in (shape_of(a) for a in call.args) if s.startswith("W")]
    return f"{call.name}({shapes[0]})" if shapes else call.name


