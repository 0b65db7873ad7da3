"""Issue #17's per-layer probe (run on a GPU: ``python3 -m tests.plugins.qwen35.gdn_layer_probe OUT``): the
GDN layers of the teacher-forced test's model (``test_qwen35_cuda.GPU_CONFIG``, seed 21) fed HF's own bf16
projections, layer by layer, through ``cuda_ops.delta_net`` under each kernel choice (the token-by-token
kernels and the chunked prefill variants), against HF's gated-normed output of the same layer. Isolates
the layer core's error from the rest of the model (the teacher-forced test sees it only through the whole
stack). Prints, per variant, the mean |error| relative to each row's RMS (the gated norm divides by it)
and the fraction of outputs that differ from HF's bf16; writes the projections and every variant's
outputs to ``OUT/gdn_layer_probe.npz`` (the CPU emulation of the kernels can rerun them) and the table
to ``OUT/gdn_layer_probe.json``. Not a pytest module (no ``test_`` prefix): the device job runs it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

# the teacher-forced test's model (test_qwen35_cuda.GPU_CONFIG; that module needs cupy at import)
PROBE_CONFIG = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "max_position_embeddings": 1024}
KERNEL_CHOICES = {"recurrent": {"OPENINFER_QWEN35_GDN_KERNELS": "recurrent"}}
ENV_NAMES = ("OPENINFER_QWEN35_GDN_KERNELS", "OPENINFER_QWEN35_GDN_PREFILL")


def relative_error(ours: np.ndarray, reference: np.ndarray, heads: int) -> float:
    """Mean |ours - reference| over each head's row RMS of ``reference`` ([T, heads * dv] both)."""
    rows = reference.shape[0]
    a, b = ours.reshape(rows, heads, -1), reference.reshape(rows, heads, -1)
    rms = np.sqrt((b.astype(np.float64) ** 2).mean(-1, keepdims=True)) + 1e-30
    return float((np.abs(a - b) / rms).mean())


def main(out_dir: str, variants: list[str], prompts: int = 2) -> dict:
    import cupy
    import torch
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import StepSequences
    from openinfer_qwen35.weights import DeltaNetWeights

    from openinfer import bf16_to_float32, create_backend, float32_to_bf16
    from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35, make_hf_model

    config_dict = {**TINY_QWEN35, **PROBE_CONFIG}
    hf, _ = make_hf_model(seed=21, base=config_dict)
    hf = hf.to(torch.bfloat16).cuda().eval()
    config = Qwen35Config.from_dict(config_dict)
    backend = create_backend("cuda")
    nv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    width = config.linear_conv_kernel_dim
    layers = [i for i, kind in enumerate(config_dict["layer_types"]) if kind == "linear_attention"]
    rng = np.random.default_rng(1)  # the teacher-forced test's prompts
    token_lists = [rng.integers(3, config_dict["vocab_size"], size=int(rng.integers(70, 200))).tolist()
                   for _ in range(prompts)]
    saved: dict[str, np.ndarray] = {}
    table: dict[str, dict[str, list[float]]] = {v: {"relative_error": [], "differs": []} for v in variants}
    for p, tokens in enumerate(token_lists):
        captured: dict[tuple[int, str], np.ndarray] = {}
        hooks = []
        for layer in layers:
            attn = hf.model.layers[layer].linear_attn
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm"):
                hooks.append(getattr(attn, name).register_forward_hook(
                    lambda mod, args, out, key=(layer, name), store=captured.__setitem__: store(
                        key, out.detach().float().cpu().numpy())))
        with torch.no_grad():
            hf(torch.tensor([tokens], device="cuda"), use_cache=False)
        for hook in hooks:
            hook.remove()
        length = len(tokens)
        for layer in layers:
            attn = hf.model.layers[layer].linear_attn
            proj = np.concatenate([captured[(layer, n)][0] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                      "in_proj_a")], axis=1)
            reference = captured[(layer, "norm")].reshape(length, nv * dv)
            weights = DeltaNetWeights(
                None, backend.weight(attn.conv1d.weight.detach().float().cpu().numpy()[:, 0, :]),
                cupy.asarray(-np.exp(attn.A_log.detach().float().cpu().numpy()).astype(np.float32)),
                cupy.asarray(attn.dt_bias.detach().float().cpu().numpy().astype(np.float32)),
                backend.weight(attn.norm.weight.detach().float().cpu().numpy()), None)
            proj_bits = float32_to_bf16(proj.astype(np.float32))
            saved[f"p{p}_l{layer}_proj"] = proj_bits
            saved[f"p{p}_l{layer}_hf"] = float32_to_bf16(reference.astype(np.float32))
            for variant in variants:
                for name in ENV_NAMES:
                    os.environ.pop(name, None)
                os.environ.update(KERNEL_CHOICES.get(variant, {"OPENINFER_QWEN35_GDN_PREFILL": variant}))
                conv_state = cupy.zeros((2, width - 1, config.conv_dim), dtype=cupy.uint16)
                ssm_state = cupy.zeros((2, nv, dk, dv), dtype=cupy.float32)
                seqs = cuda_ops.prepare_sequences(StepSequences(np.array([0, length]), np.array([1]),
                                                                np.array([True])))
                out = cuda_ops.delta_net(cupy.asarray(proj_bits), weights, conv_state, ssm_state, seqs, config)
                bits = cupy.asnumpy(out)
                saved[f"p{p}_l{layer}_{variant}"] = bits
                ours = bf16_to_float32(bits)
                table[variant]["relative_error"].append(relative_error(ours, reference, nv))
                table[variant]["differs"].append(float((ours != reference).mean()))
    for name in ENV_NAMES:
        os.environ.pop(name, None)
    summary = {v: {k: float(np.mean(x)) for k, x in t.items()} for v, t in table.items()}
    for variant, row in summary.items():
        print(f"gdn layer vs HF {variant:16s} relative |err| {row['relative_error']:.3e}  "
              f"differs {row['differs']:.3f}", flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "gdn_layer_probe.npz", **saved)
    (out / "gdn_layer_probe.json").write_text(json.dumps({"summary": summary, "per_layer_prompt": table,
                                                          "layers": layers, "prompts": prompts}, indent=1))
    return summary


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ["recurrent", "grouped_staged",
                                                                        "grouped_f16", "plain"])
