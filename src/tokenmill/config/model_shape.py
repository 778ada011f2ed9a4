"""The shape of a model: its sizes and what its architecture changes in the shared decoder. model/config.py reads
one from a GGUF's metadata, model/hf_config.py from a checkpoint's config.json; the model, the runner and tensor
parallelism's plan (distributed/shard.py) read it. A plain dataclass: no torch, no numpy, no file reading here."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # context length the model was trained for
    tie_word_embeddings: bool
    # what an architecture changes in the shared decoder (defaults: llama)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope
    sandwich_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs too (Gemma)
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sliding_window: int | None = None  # local layers attend to at most this many latest positions
    local_layers: tuple[bool, ...] = ()  # per layer: attends to its sliding window only (the others: everything)
    local_rope_theta: float | None = None  # the local layers' rope base, when different
    # rope scaling, of the global layers only (Gemma 3's local layers keep their plain frequencies; llama has no
    # local layers): every frequency divided by rope_scale (linear: Gemma 3 4B's 8), and each by its own factor
    # (Llama 3's scaling: [rotary_dim / 2], GGUF's rope_freqs tensor; YaRN's ramp), and cos and sin multiplied by
    # rope_attention_factor (YaRN's)
    rope_scale: float = 1.0
    rope_freq_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    rope_rows_permuted: bool = True  # Q/K rows stored permuted for ggml's interleaved rope (llama's GGUF files)
    attention_bias: bool = False  # Q, K and V projections have biases (Qwen2)
    attention_scale: float | None = None  # softmax scale of the attention scores (None: 1 / sqrt(head_dim))
    norm_scale_in_float32: bool = False  # RMSNorm weights multiply before rounding to a lower dtype (Gemma)
    qk_norm_whole: bool = False  # the QK-norm spans the whole Q and K projections, not each head (OLMoE)
    # mixture of experts (layers/moe.py): in the layers `moe_layers` marks, the MLP is `num_experts` experts of
    # width `expert_intermediate_size`, of which a router picks `experts_per_token` for each token (softmax over
    # all experts, the top k kept; their weights renormalized to sum 1 where `expert_weights_normalized`); with
    # `shared_expert_intermediate_size`, a dense expert every token takes, gated by a sigmoid (Qwen2-MoE). The
    # other layers keep the dense MLP of `intermediate_size`.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    expert_weights_normalized: bool = False
    moe_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0
    expert_weights_scale: float = 1.0  # the chosen experts' weights multiplied by this (after renormalizing)
    # gpt-oss: the router's top k logits first, then a softmax over them; biases on the router and every expert
    expert_softmax_after_topk: bool = False
    expert_biases: bool = False
    attention_output_bias: bool = False  # the output projection has a bias too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in each query's softmax (gpt-oss: `attn_sinks`)
    ffn_norm_name: str = "ffn_norm"  # the GGUF name of the norm before the MLP (gpt-oss: post_attention_norm)

    def is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer < len(self.moe_layers) and self.moe_layers[layer]

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends only to its sliding window."""
        return self.sliding_window is not None and layer < len(self.local_layers) and self.local_layers[layer]

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)
