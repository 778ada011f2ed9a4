"""gpt-oss's MXFP4 experts as the Hub ships them (`*_blocks` uint8 [experts, rows, columns / 32, 16] and `*_scales`
uint8 [experts, rows, columns / 32]) into GGUF's MXFP4 rows, which the native products and the dequantizer read.

Both hold, per 32 values, one E8M0 exponent and 32 e2m1 codes (value = FP4[code] * 2^(exponent - 127)); they
differ in where each code sits: the Hub's byte i holds values 2i (low nibble) and 2i + 1 (high nibble), as
transformers' `convert_moe_packed_tensors` reads them; GGUF's block is the exponent, then byte j holding values j
(low) and j + 16 (high), as ggml's dequantize_row_mxfp4 reads them (llama.cpp's converter moves them the same way).
"""

import numpy as np

MXFP4_BLOCK_BYTES = 17  # GGUF: 1 exponent byte + 16 bytes of codes per 32 values


def gguf_mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One expert's blocks uint8 [rows, groups, 16] and scales uint8 [rows, groups] (the Hub's layout) -> GGUF MXFP4
    rows uint8 [rows, groups * 17]."""
    if blocks.ndim != 3 or blocks.shape[2] != 16 or scales.shape != blocks.shape[:2]:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    rows, groups = scales.shape
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(rows, groups, 32)  # value order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # GGUF: byte j holds values j and j + 16
    return np.concatenate([scales[..., None], packed], axis=-1).astype(np.uint8).reshape(rows, -1)
