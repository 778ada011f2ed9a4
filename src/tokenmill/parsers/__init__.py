"""A reply's text read back as its parts: the thinking, the answer and the tool calls, in the model's own format.

reply.py chooses the format from the model's chat template (or --reasoning-parser / --tool-call-parser) and
splits a reply as it streams (ReplyParser); think.py reads `<think>...</think>` (Qwen3, DeepSeek-R1's distills,
SmolLM3), harmony.py OpenAI's harmony messages (gpt-oss), tool_formats.py the models' tool-call syntaxes (Hermes'
and Qwen's `<tool_call>`, Llama 3's JSON, Mistral's `[TOOL_CALLS]`, tokenmill's constrained JSON). No torch here.
"""
