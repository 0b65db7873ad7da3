"""Issue #17 on the CPU: the teacher-forced test (test_qwen35_cuda.test_teacher_forced_logprobs_match_hf_bf16)
emulated with HF's Qwen3.5 in bf16 on the CPU, its chunked delta rule swapped for the NumPy operand model
(gdn_operand_model.py) at each rounding choice, so the metric's response to each rounding point can be
read without a GPU. ``python3 -m tests.plugins.qwen35.gdn_teacher_forced_emulation [PROMPTS] [OUT.json]
[NAME,...]`` (the test's first PROMPTS prompts, default 4; about 3 s a choice; NAMES: only the choices whose
names contain one of them).

Prints, per choice, mean / p99 |Δlogprob| on HF's top token against HF itself (whose chunked rule runs in
fp32) and against the fp64 token-by-token rule. Measured 2026-11-24 (4 prompts, 421 positions; the device's
12-prompt figures in brackets): token-by-token 0.0055 [0.0074], bf16 operands 0.0173 [0.0173], fp16 operands
0.0149 [0.0138], any single bf16 point ~0.016, 16-bit hi / lo splits 0.0092, fp16 hi + scaled lo 0.0056;
exact q / k with 16-bit splits elsewhere 0.0100, with 24-bit splits (16-bit W / Tbe) 0.0053."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests.plugins.qwen35 import gdn_operand_model as model

# the teacher-forced test's model (test_qwen35_cuda.GPU_CONFIG; that module needs cupy at import)
GPU_SHAPE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "max_position_embeddings": 1024}
CHOICES = {
    "bf16 (grouped_staged)": model.everywhere(model.bf16),
    "fp16 (grouped_f16)": model.everywhere(model.fp16),
    **{f"bf16 at {point} only": {point: model.bf16} for point in ("qk", "U", "P", "Vn")},
    "bf16 hi/lo": model.everywhere(model.bf16_hi_lo),
    "fp16 hi/lo": model.everywhere(model.fp16_hi_lo),
    "fp16 hi + scaled lo": model.everywhere(model.fp16_hi_scaled_lo),
    "fp16 hi + scaled lo, fp16 W / Tbe": model.everywhere(model.fp16_hi_scaled_lo, W=model.fp16, Tbe=model.fp16),
    "bf16 hi/mid/lo": model.everywhere(model.bf16_hi_mid_lo),
    # the fix's design: q / k products on the raw bf16 rows (exact), 24-bit splits elsewhere, 16-bit W / Tbe
    "exact q/k, hi/lo elsewhere": model.everywhere(model.bf16_hi_lo, qk=model.exact),
    "exact q/k, hi/mid/lo, hi/lo W / Tbe": model.everywhere(model.bf16_hi_mid_lo, qk=model.exact,
                                                            W=model.bf16_hi_lo, Tbe=model.bf16_hi_lo),
    # gdn_chunked_split.cu (OPENINFER_QWEN35_GDN_PREFILL=chunked_split) as built: U, W, P, V' fp32 between
    # the kernels; T diag(beta) in 3 parts and T diag(beta exp c) in 2 against exact bf16 V / K; S and
    # diag(exp(c_C - c)) V' in 3 parts against exact q / k; W S as W 2 parts x S 3 parts keeping hi*hi, hi*mid,
    # mid*hi; P V' 3 x 3 parts keeping hi*hi, hi*mid, mid*hi, hi*lo, lo*hi, mid*mid. 12 prompts: 0.0060 / 0.0301
    # (with W S's hi*lo too 0.0058 / 0.0303; P V' as hi*hi, hi*mid, mid*hi 0.0098; T diag(beta) in 2 parts
    # 0.0077; S or diag(exp(c_C - c)) V' in 2 parts 0.0063)
    "chunked_split (the kernel's terms)": {
        "qk": model.exact, "Tb": model.bf16_hi_mid_lo, "Tbe": model.bf16_hi_lo, "S": model.bf16_hi_mid_lo,
        "Vd": model.bf16_hi_mid_lo,
        "WS": model.split_product(2, 3, ((0, 0), (0, 1), (1, 0))),
        "PV": model.split_product(3, 3, ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1)))},
    # chunked_split_f16 (gdn_chunk_prepare_split_f16 / gdn_chunk_walk_split_f16): every operand as fp16 hi + lo x
    # 2^-11 against exact q / k / v, W S and P V' as hi*hi + hi*lo + lo*hi. 12 prompts: 0.0058 / 0.0297 (dropping
    # any one part costs: W S's W to hi 0.0071, to hi*hi 0.0075; P or V' to hi 0.013-0.014; diag(exp(c_C - c)) V',
    # S or T diag(beta exp c) to one fp16 part ~0.0077; T = (I + A)^-1 rounded to 22 bits 0.0059, to 16 bits 0.0073)
    "chunked_split_f16 (the kernel's terms)": {
        **model.everywhere(model.fp16_hi_scaled_lo, qk=model.exact),
        "WS": model.fp16_split_product(), "PV": model.fp16_split_product()},
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(num_prompts: int = 4, out_path: str | None = None, only: tuple[str, ...] = ()) -> dict:
    """``only``: the CHOICES whose names contain one of these (all when empty)."""
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf_module

    from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35, make_hf_model

    hf, _ = make_hf_model(seed=21, base={**TINY_QWEN35, **GPU_SHAPE})
    hf = hf.to(torch.bfloat16).eval()
    hf_chunked = hf_module.torch_chunk_gated_delta_rule
    choice: dict = {"rounding": None}

    def delta_rule(query, key, value, g, beta, **kwargs):
        if choice["rounding"] is None:
            return hf_chunked(query, key, value, g=g, beta=beta, **kwargs)
        q, k, v, gates, betas = (x.detach().float().numpy()[0].astype(np.float64) for x in (query, key, value, g, beta))
        num_key_heads, num_value_heads, dk = q.shape[1], v.shape[1], q.shape[2]
        out = np.empty_like(v)
        for h in range(num_value_heads):
            kh = h // (num_value_heads // num_key_heads)
            args = (model.l2_normed(q[:, kh], dk**-0.5), model.l2_normed(k[:, kh]), v[:, h], gates[:, h], betas[:, h])
            out[:, h] = (model.recurrent(*args) if choice["rounding"] == "token-by-token"
                         else model.chunked(*args, choice["rounding"]))
        return torch.tensor(out[None], dtype=torch.bfloat16), None

    hf_module.torch_chunk_gated_delta_rule = delta_rule
    try:
        rng = np.random.default_rng(1)  # the teacher-forced test's prompts
        prompts = [rng.integers(3, GPU_SHAPE["vocab_size"], size=int(rng.integers(70, 200))).tolist()
                   for _ in range(num_prompts)]

        def logits(rounding) -> list[np.ndarray]:
            choice["rounding"] = rounding
            with torch.no_grad():
                return [hf(torch.tensor([p]), use_cache=False).logits[0].float().numpy() for p in prompts]

        def deltas(ours: list[np.ndarray], reference: list[np.ndarray]) -> dict:
            diffs = np.concatenate([np.abs(log_softmax(o)[np.arange(len(o)), r.argmax(-1)]
                                           - log_softmax(r)[np.arange(len(o)), r.argmax(-1)])
                                    for o, r in zip(ours, reference, strict=True)])
            return {"mean": float(diffs.mean()), "p99": float(np.percentile(diffs, 99)), "positions": int(diffs.size)}

        hf_logits = logits(None)
        token_by_token = logits("token-by-token")
        results = {"token-by-token": {"vs_hf": deltas(token_by_token, hf_logits)}}
        print(f"{'token-by-token (fp64)':36s} vs HF {results['token-by-token']['vs_hf']}", flush=True)
        for name, rounding in CHOICES.items():
            if only and not any(part in name for part in only):
                continue
            ours = logits(rounding)
            results[name] = {"vs_hf": deltas(ours, hf_logits), "vs_token_by_token": deltas(ours, token_by_token)}
            print(f"{name:36s} vs HF {results[name]['vs_hf']}  vs token-by-token "
                  f"{results[name]['vs_token_by_token']}", flush=True)
    finally:
        hf_module.torch_chunk_gated_delta_rule = hf_chunked
    if out_path:
        Path(out_path).write_text(json.dumps({"prompts": num_prompts, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, sys.argv[2] if len(sys.argv) > 2 else None,
         tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ())
