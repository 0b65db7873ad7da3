"""openinfer plugin for the DeepSeek-V3 architecture: Kimi-K2 (Instruct, Thinking INT4), DeepSeek-V3, Moonlight."""
