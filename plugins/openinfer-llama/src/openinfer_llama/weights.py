"""Where Llama's tensors live: the standard dense-decoder layout, nothing more.

``openinfer.load_decoder_stack`` reads it and fuses each layer's projections so a step runs one
GEMM where HF runs two or three::

    model.layers.{i}.self_attn.{q,k,v}_proj.weight  →  qkv      [q_size + 2*kv_size, hidden]
    model.layers.{i}.mlp.{gate,up}_proj.weight      →  gate_up  [2*intermediate,     hidden]

Biases are read when ``attention_bias`` / ``mlp_bias`` say so; the LM head is ``lm_head.weight``
or, tied, the embedding table. Shapes are checked against config.json before anything loads.
"""

from openinfer import DecoderLayout

LLAMA_LAYOUT = DecoderLayout(prefix="model.", qk_norm=False)
