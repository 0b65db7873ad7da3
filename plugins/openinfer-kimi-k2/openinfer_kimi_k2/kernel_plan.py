"""Which kernel runs each Kimi-K2 / DeepSeek-V3 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of
one), *decode* when it brings exactly one; a *mixed* step holds both kinds (each sequence
takes its own path).

=====================  ================================  ================================  =======
op                     prefill                           decode                            from
=====================  ================================  ================================  =======
embedding              core ``embedding``                same                              core
norms                  core ``rms_norm`` / ``add_rms_    same                              core
                       norm``
q_a + kv_a (fused)     core ``linear``                   same                              core
q_b, o_proj            core ``linear``                   same                              core
RoPE (q_pe, k_pe)      ``mla.rotate_half_rope`` on the   same                              core
                       de-interleaved rope dims
MLA attention          ``mla.mla_naive``: expand the     ``mla.mla_absorbed``: W_UK into   core
                       context's latents per head        q, attend over 576-wide latents,
                                                         W_UV after the weighted sum
dense MLP              core ``linear`` + ``silu_mul``    same                              core
MoE router             ``moe.route`` (fp32, host)        same                              core
routed experts         ``moe.run_experts``: tokens       same                              core
                       grouped by expert, one GEMM per
                       active expert, scatter-add
shared experts         core ``linear`` + ``silu_mul``    same                              core
=====================  ================================  ================================  =======

Quantized checkpoints (FP8 block, INT4 pack-quantized) are dequantized to fp32 at load on the
NumPy backend (``openinfer.quant``). The CUDA backend is not wired for this model yet: building
it on ``device="cuda"`` raises ``BackendUnavailableError`` naming this plugin.
"""

from __future__ import annotations

from openinfer import Backend
from openinfer.errors import BackendUnavailableError


def check_backend(backend: Backend) -> None:
    if backend.name != "numpy":
        raise BackendUnavailableError(
            f"openinfer-kimi-k2 runs on the numpy backend only for now (got {backend.name!r}); "
            "serve it with --device cpu")
