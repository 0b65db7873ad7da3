"""Shared set-up of the GPU MLA tests: a ragged paged step and its NumPy reference."""

from __future__ import annotations

import numpy as np

from openinfer import RotaryEmbedding
from openinfer.backend.base import ForwardBatch
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.mla import MLASpec, MLAWeights, mla_attention, rotate_half_rope
from openinfer.rope import RopeParameters
from tests.gpu.conftest import bf16_random

REF = NumpyBackend()


def ragged_mla_step(rng: np.random.Generator, spec: MLASpec, cached: list[int], new: list[int],
                    block_size: int = 16) -> tuple:
    """A paged batch over shuffled cache blocks (sequence ``i``: ``cached[i]`` tokens in the cache,
    ``new[i]`` new ones), its inputs, the NumPy reference output and the reference's cache after it
    wrote the new latents: ``(batch, cache, q, latent, norm, weights, rope, reference, ref_cache)``."""
    max_blocks = -(-max(np.add(cached, new)) // block_size)
    num_blocks = len(cached) * max_blocks + 1
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]).astype(np.int32)
    tables = np.zeros((len(cached), max_blocks), np.int32)
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    for s, total in enumerate(np.add(cached, new)):
        for b in range(-(-total // block_size)):
            tables[s, b] = next(free)
    slots = np.concatenate([tables[s, p // block_size] * block_size + p % block_size
                            for s, p in enumerate(np.split(positions, np.cumsum(new)[:-1]))]).astype(np.int32)
    batch = ForwardBatch(token_ids=np.zeros(len(positions), np.int32), positions=positions,
                         query_start=np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
                         context_lens=np.add(cached, new).astype(np.int32), block_tables=tables, slot_mapping=slots,
                         logits_rows=np.arange(len(positions), dtype=np.int32), max_query_len=max(new),
                         max_context_len=int(np.max(np.add(cached, new))))
    cache = bf16_random(rng, num_blocks, block_size, spec.latent_dim)
    q = bf16_random(rng, len(positions), spec.num_heads * spec.qk_head_dim)
    latent = bf16_random(rng, len(positions), spec.latent_dim)
    norm = 1 + bf16_random(rng, spec.kv_lora_rank, scale=0.2)
    kv_b = bf16_random(rng, spec.num_heads * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank, scale=0.05)
    weights = MLAWeights.from_kv_b(kv_b, spec)
    rope = RotaryEmbedding.create(spec.qk_rope_dim, RopeParameters(10000.0), max(256, int(positions.max()) + 1))
    cos, sin = rope.cos[positions], rope.sin[positions]
    q3 = q.reshape(-1, spec.num_heads, spec.qk_head_dim)
    nope = spec.qk_nope_dim
    q_ref = np.concatenate([q3[..., :nope], rotate_half_rope(q3[..., nope:], cos, sin)], -1)
    c_kv = REF.rms_norm(latent[:, :spec.kv_lora_rank], norm, 1e-6)
    k_pe = rotate_half_rope(latent[:, None, spec.kv_lora_rank:], cos, sin)[:, 0]
    ref_cache = cache.copy()
    reference = mla_attention(q_ref, np.concatenate([c_kv, k_pe], -1), ref_cache, weights, spec, batch)
    return batch, cache, q, latent, norm, weights, rope, reference, ref_cache
