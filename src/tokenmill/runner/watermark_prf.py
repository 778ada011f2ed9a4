"""The watermark's pseudo-random function, bit for bit vLLM's "philox4x32-10-v1" (vllm/v1/watermarking/prfs): a
uniform number in (0, 1) for every (context, token) pair under a 64-bit key, from Philox4x32-10 (Salmon et al.,
https://doi.org/10.1145/2063384.2063405), so that text tokenmill watermarks is detected by vLLM's detector and the
other way round.

The context (the generated tokens before the token, -1 where there are fewer) is absorbed four words at a time into
a 128-bit state; each token's number is then word `token % 4` of one more Philox block whose counter is
`token // 4` with that state: one block serves four tokens, so a whole vocabulary costs a quarter of its size in
blocks. Words are uint32 held in int64 tensors (torch has no uint32 arithmetic on every device).
"""

import torch

UINT32 = 2**32 - 1
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # its key schedule (Weyl sequence)
_CONTEXT_DOMAIN = 0x574D4358  # "WMCX"
_TOKEN_DOMAIN = 0x574D544B  # "WMTK"

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of multiplier * x, in 16-bit halves (the product overflows int64)."""
    x_lo, x_hi = x & 0xFFFF, x >> 16
    m_lo, m_hi = multiplier & 0xFFFF, multiplier >> 16
    cross = x_hi * m_lo + x_lo * m_hi
    low = x_lo * m_lo + ((cross & 0xFFFF) << 16)
    high = (x_hi * m_hi + (cross >> 16) + (low >> 32)) & UINT32
    return high, low & UINT32


def philox(counter: Words, key: tuple[torch.Tensor, torch.Tensor]) -> Words:
    """Philox4x32 with 10 rounds over broadcastable word tensors."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = (hi1 ^ c1 ^ k0) & UINT32, lo1, (hi0 ^ c3 ^ k1) & UINT32, lo0
        if round_index != 9:
            k0, k1 = (k0 + _W0) & UINT32, (k1 + _W1) & UINT32
    return c0, c1, c2, c3


def context_state(key: int, contexts: torch.Tensor) -> tuple[Words, torch.Tensor, torch.Tensor]:
    """contexts [..., W] int64 (-1: before the reply) -> the state each context leaves [...] x 4, and the key words
    [...] x 2 the tokens' block takes."""
    contexts = contexts.to(torch.int64) & UINT32
    shape, device, width = contexts.shape[:-1], contexts.device, contexts.shape[-1]

    def full(value: int) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.int64, device=device)

    k0, k1 = full(key & UINT32), full(key >> 32)
    state: Words = (full(_CONTEXT_DOMAIN), full(width), full(0), full(0))
    for offset in range(0, width, 4):
        block = [contexts[..., offset + i] if offset + i < width else full(UINT32 - i) for i in range(4)]
        counter = tuple((state[i] ^ block[i]) & UINT32 for i in range(4))
        state = philox(counter, ((k0 ^ offset) & UINT32, k1))  # type: ignore[arg-type]
    return state, k0, k1


def _token_words(state: Words, k0: torch.Tensor, k1: torch.Tensor, groups: torch.Tensor) -> Words:
    """The four words of each token group's block: groups broadcast against the state's shape plus one axis."""
    s0, s1, s2, s3 = (w.unsqueeze(-1) for w in state)
    key = ((k0.unsqueeze(-1) ^ s3) & UINT32, (k1.unsqueeze(-1) ^ _TOKEN_DOMAIN) & UINT32)
    return philox((groups.expand(torch.broadcast_shapes(groups.shape, s0.shape)), s0, s1, s2), key)


def to_uniform(words: torch.Tensor) -> torch.Tensor:
    """uint32 words -> float32 in (0, 1): their top 24 bits, as vLLM maps them."""
    return (((words & UINT32) >> 8).to(torch.float64) + 1.0).div(2**24 + 1).to(torch.float32)


def uniform(key: int, contexts: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The number of each (context, token) pair: contexts [..., W], token_ids broadcastable to [..., N] -> float32
    [..., N] (vLLM's PhiloxPRF.uniform)."""
    state, k0, k1 = context_state(key, contexts)
    tokens = token_ids.to(device=contexts.device, dtype=torch.int64) & UINT32
    words = _token_words(state, k0, k1, tokens >> 2)
    index = tokens & 3
    out = words[0]
    for i in range(1, 4):
        out = torch.where(index == i, words[i], out)
    return to_uniform(out)


def vocabulary_uniform(key: int, contexts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every token's number under each context: contexts [R, W] -> float32 [R, vocab_size], one block per four
    tokens."""
    state, k0, k1 = context_state(key, contexts)
    groups = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=contexts.device)
    words = torch.stack(_token_words(state, k0, k1, groups), dim=-1)  # [R, groups, 4]: token 4g + i at [g, i]
    return to_uniform(words.flatten(-2)[..., :vocab_size])
