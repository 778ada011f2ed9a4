"""Building blocks of the model architectures: norms, rotary embedding, linear layers, paged attention."""
