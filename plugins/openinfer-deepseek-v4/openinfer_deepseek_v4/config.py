"""DeepSeek-V4 configuration: ``config.json`` in either spelling, read into one frozen dataclass.

Two spellings reach us (MODELS.md §0, §1.1):

- the real checkpoints' *legacy* keys: ``compress_ratios`` (one int per layer, plus one for the
  MTP block: 0 = sliding window only, 4 = CSA, 128 = HCA), ``num_hash_layers``, ``rope_theta`` +
  ``rope_scaling`` (YaRN, for the compressed layers only), ``qk_rope_head_dim``;
- transformers 5.x ``save_pretrained`` keys: ``layer_types``, ``compress_rates``,
  ``mlp_layer_types``, ``rope_parameters = {main: ..., compress: ...}``, ``partial_rotary_factor``.

Every layer keeps a sliding window of ``sliding_window`` tokens; CSA layers add one compressed
entry per ``compress_rates[CSA]`` tokens chosen per query by the indexer, HCA layers one entry per
``compress_rates[HCA]`` tokens, all visible. Sliding-only layers rotate with ``rope_theta``
(no scaling); compressed layers with ``compress_rope_theta`` and YaRN without mscale.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from openinfer import RopeParameters, WeightLoadError, eos_token_ids_from

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
MODEL_TYPES = ("deepseek_v4",)

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


# The published DeepSeek-V4-Flash config.json (legacy keys), less fields nothing here reads. The one
# copy behind flash_config(): benchmarks and tests of Flash shapes derive their configs from it.
_FLASH_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def flash_config() -> dict[str, Any]:
    """A fresh copy of DeepSeek-V4-Flash's config.json (legacy keys: 43 layers, hidden 4096, 64 heads
    of 512, 256 FP4 experts top-6 + 1 shared, FP8 e4m3 linears): the shape benchmarks and tests
    build on (``{**flash_config(), "num_hidden_layers": 1, ...}``)."""
    return copy.deepcopy(_FLASH_CONFIG)


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # attention: one shared K=V head of head_dim, rope on the last rope_head_dim channels
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # ((CSA, 4), (HCA, 128))
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # RoPE: "main" for sliding-only layers, "compress" for CSA/HCA layers and the compressors
    rope_main: RopeParameters
    rope_compress: RopeParameters
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # MoE
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    # the rest
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_nextn_predict_layers: int
    mtp_layer_type: str = SLIDING  # the MTP block's attention (compress_ratios' extra entry)
    quantization: tuple[tuple[str, Any], ...] = ()

    # --- derived --------------------------------------------------------------------------------

    def compress_rate(self, layer_type: str) -> int:
        return dict(self.compress_rates).get(layer_type, 0)

    def layer_compress_rate(self, layer: int) -> int:
        """0 for sliding-only layers, else the layer's compression rate."""
        return self.compress_rate(self.layer_types[layer])

    def layer_ids(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == layer_type)

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def quantization_config(self) -> dict[str, Any]:
        return dict(self.quantization)

    # --- reading config.json --------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> DeepseekV4Config:
        def req(key: str, default: Any = None) -> Any:
            value = config.get(key, default)
            if value is None:
                raise WeightLoadError(f"DeepSeek-V4 config.json lacks {key!r}")
            return value

        num_layers = int(req("num_hidden_layers", 43))
        head_dim = int(req("head_dim", 512))
        heads = int(req("num_attention_heads", 64))
        if int(config.get("num_key_value_heads", 1)) != 1:
            raise WeightLoadError("DeepSeek-V4 attention shares one K=V head: num_key_value_heads must be 1, "
                                  f"config.json has {config['num_key_value_heads']}")

        compress_rates = dict(DEFAULT_COMPRESS_RATES)
        compress_rates.update(config.get("compress_rates") or {})
        for legacy_key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if config.get(legacy_key) is not None:
                compress_rates[kind] = int(config[legacy_key])
        layer_types = _layer_types(config, num_layers)
        mlp_layer_types = _mlp_layer_types(config, num_layers)

        partial = config.get("partial_rotary_factor")
        if config.get("qk_rope_head_dim") is not None:
            rope_head_dim = int(config["qk_rope_head_dim"])
        elif partial is not None:
            rope_head_dim = int(head_dim * float(partial))
        else:
            rope_head_dim = 64 if head_dim >= 64 else head_dim // 8
        rope_main, rope_compress = _rope_parameters(config, rope_head_dim / head_dim)

        scoring = str(config.get("scoring_func", "sqrtsoftplus"))
        if scoring not in SCORING_FUNCS:
            raise WeightLoadError(f"config.json has scoring_func={scoring!r}; supported: {SCORING_FUNCS}")
        quant = config.get("quantization_config") or {}
        if quant and quant.get("quant_method", "fp8") != "fp8":
            raise WeightLoadError(f"quantization_config.quant_method={quant.get('quant_method')!r} is not a "
                                  "DeepSeek-V4 format; expected 'fp8' (FP8 e4m3 + e8m0 scales, FP4 experts)")
        if config.get("expert_dtype") and "expert_dtype" not in quant:
            quant = {**quant, "expert_dtype": config["expert_dtype"]}
        cfg = cls(
            vocab_size=int(req("vocab_size", 129280)), hidden_size=int(req("hidden_size", 4096)),
            num_hidden_layers=num_layers, num_attention_heads=heads, head_dim=head_dim,
            rope_head_dim=rope_head_dim, q_lora_rank=int(req("q_lora_rank", 1024)),
            o_groups=int(req("o_groups", 8)), o_lora_rank=int(req("o_lora_rank", 1024)),
            sliding_window=int(req("sliding_window", 128)), layer_types=layer_types,
            compress_rates=tuple(sorted((k, int(v)) for k, v in compress_rates.items())),
            index_n_heads=int(req("index_n_heads", 64)), index_head_dim=int(req("index_head_dim", 128)),
            index_topk=int(req("index_topk", 512)), rope_main=rope_main, rope_compress=rope_compress,
            hc_mult=int(req("hc_mult", 4)), hc_sinkhorn_iters=int(req("hc_sinkhorn_iters", 20)),
            hc_eps=float(req("hc_eps", 1e-6)), mlp_layer_types=mlp_layer_types,
            n_routed_experts=int(req("n_routed_experts", 256)),
            num_experts_per_tok=int(req("num_experts_per_tok", 6)),
            n_shared_experts=int(config.get("n_shared_experts", 1) or 0),
            moe_intermediate_size=int(req("moe_intermediate_size", 2048)), scoring_func=scoring,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(config.get("swiglu_limit") or 0.0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=eos_token_ids_from(config, generation_config),
            bos_token_id=config.get("bos_token_id", 0),
            num_nextn_predict_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
            mtp_layer_type=_mtp_layer_type(config, num_layers),
            quantization=tuple(sorted((str(k), _freeze(v)) for k, v in quant.items())),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise WeightLoadError(f"rope head dim {self.rope_head_dim} must be even and at most head_dim "
                                  f"({self.head_dim}) and index_head_dim ({self.index_head_dim})")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise WeightLoadError(f"num_attention_heads·head_dim ({self.num_attention_heads * self.head_dim}) "
                                  f"must divide into o_groups ({self.o_groups})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise WeightLoadError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                                  f"({self.n_routed_experts})")
        for kind in set(self.layer_types) - {SLIDING}:
            if self.compress_rate(kind) < 1:
                raise WeightLoadError(f"compress rate of {kind} must be positive, got {self.compress_rate(kind)}")


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _layer_types(config: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types`` wins; else the legacy ``compress_ratios`` (its extra MTP entries dropped)."""
    types = config.get("layer_types")
    if types is None and config.get("compress_ratios") is not None:
        ratios = list(config["compress_ratios"])
        bad = [r for r in ratios if r not in _RATIO_TO_LAYER_TYPE]
        if bad:
            raise WeightLoadError(f"compress_ratios has {bad}; each entry must be 0 (sliding), 4 (CSA) or 128 (HCA)")
        types = [_RATIO_TO_LAYER_TYPE[r] for r in ratios]
    if types is None:  # transformers' default: 2 HCA, then CSA/HCA interleaved
        types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    types = list(types)[:num_layers]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise WeightLoadError(f"layer_types must list {num_layers} entries from {LAYER_TYPES}, got {types}")
    return tuple(types)


def _mtp_layer_type(config: dict[str, Any], num_layers: int) -> str:
    ratios = config.get("compress_ratios")
    if isinstance(ratios, list) and len(ratios) > num_layers and ratios[num_layers] in _RATIO_TO_LAYER_TYPE:
        return _RATIO_TO_LAYER_TYPE[ratios[num_layers]]
    return SLIDING


def _mlp_layer_types(config: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = config.get("mlp_layer_types")
    if types is None:
        num_hash = int(config.get("num_hash_layers", 3) or 0)
        types = [HASH_MOE] * min(num_layers, num_hash) + [MOE] * max(0, num_layers - num_hash)
    types = list(types)[:num_layers]
    if len(types) != num_layers or any(t not in MLP_LAYER_TYPES for t in types):
        raise WeightLoadError(f"mlp_layer_types must list {num_layers} entries from {MLP_LAYER_TYPES}, got {types}")
    return tuple(types)


def _rope_parameters(config: dict[str, Any], partial: float) -> tuple[RopeParameters, RopeParameters]:
    """(main, compress). YaRN (if any) applies to the compressed layers only, never with mscale:
    the reference forces ``attention_factor = 1``."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        main_dict, compress_dict = dict(params["main"]), dict(params.get("compress") or {})
    else:
        scaling = dict(config.get("rope_scaling") or {})
        if isinstance(params, dict):
            scaling.update({k: v for k, v in params.items() if k not in ("rope_theta",)})
        main_dict = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress_dict = {**scaling, "rope_theta": config.get("compress_rope_theta", 160000.0)}
    return _rope(main_dict, partial, force_unit_attention=False), _rope(compress_dict, partial, True)


def _rope(params: dict[str, Any], partial: float, force_unit_attention: bool) -> RopeParameters:
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", 10000.0))
    params.pop("partial_rotary_factor", None)
    if rope_type not in ("default", "yarn"):
        raise WeightLoadError(f"DeepSeek-V4 rope type {rope_type!r} is not supported (default or yarn)")
    if rope_type == "yarn":
        if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
            raise WeightLoadError("DeepSeek-V4 YaRN rope needs 'factor' and 'original_max_position_embeddings'")
        if force_unit_attention:
            params.setdefault("attention_factor", 1.0)
    else:
        params = {}
    return RopeParameters(theta, rope_type, tuple(sorted(params.items())), partial)
