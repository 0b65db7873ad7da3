"""Where Qwen3's tensors live and what sets it apart from a plain dense decoder.

Qwen3 = the standard layout (``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
fused into qkv and gate_up at load by ``openinfer.load_decoder_stack``) plus a per-head RMSNorm
on q and k (``self_attn.q_norm`` / ``k_norm``) applied before RoPE. With ``attention_bias`` the
q/k/v and o projections carry biases.
"""

from openinfer import DecoderLayout

QWEN3_LAYOUT = DecoderLayout(prefix="model.", qk_norm=True)
