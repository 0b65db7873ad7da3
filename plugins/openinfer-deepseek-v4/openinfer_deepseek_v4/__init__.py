"""openinfer plugin for DeepSeek-V4 (``DeepseekV4ForCausalLM``, model_type ``deepseek_v4``).

Read top-down: ``config`` → ``weights`` → ``attention`` / ``hyper_connection`` / ``moe`` →
``state`` → ``model`` → ``kernel_plan`` → ``plugin``; ``chat`` holds the chat encoding.
"""
