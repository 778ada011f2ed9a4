"""The model runner: device, KV cache tensors, per-step input tensors, forward and sampling."""
