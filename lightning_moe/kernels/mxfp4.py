"""MXFP4 expert weights (OCP Microscaling FP4, as gpt-oss checkpoints store them): the torch reference dequantization.

A projection of R output rows and C input columns is stored as ``blocks`` uint8 [..., R, C / 32, 16] (32 E2M1 values
per block, two per byte: the low nibble first) and ``scales`` uint8 [..., R, C / 32] (one E8M0 exponent per block,
bias 127). Value = FP4_VALUES[nibble] * 2 ** (scale - 127). This module is the reference the Triton kernel that
dequantizes in registers (a later step) will be checked against; the loader uses it to dequantize on load.
"""

from __future__ import annotations

import torch

# E2M1 code -> value (code 8..15: the negatives; 8 is -0.0), transformers' integrations/mxfp4.py FP4_VALUES
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0 exponent bias


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize MXFP4 ``blocks`` uint8 [E, R, G, 16] with ``scales`` uint8 [E, R, G] into ``dtype``, returned as
    [E, G*32, R] (contiguous): the input dim first, as transformers' GptOssExperts parameters hold it (gate_up_proj
    [E, D, 2F], down_proj [E, F, D]).

    The same operations as transformers' ``convert_moe_packed_tensors`` (a lookup table in ``dtype``, the low nibble
    to even positions and the high one to odd ones, ``torch.ldexp`` by scale - 127 into the ``dtype`` buffer), in one
    pass instead of row chunks, so the result is bit for bit transformers'. Raises ValueError on mismatched shapes.
    """
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4_dequantize: blocks {tuple(blocks.shape)} must be [E, R, G, 16] and scales "
                         f"{tuple(scales.shape)} [E, R, G]")
    E, R, G, B = blocks.shape
    blocks = blocks.to(torch.uint8).reshape(E * R * G, B)  # [N, 16] with N = E*R*G blocks
    exp = (scales.to(torch.int32) - SCALE_BIAS).reshape(E * R * G, 1)  # [N, 1]
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)  # [16]
    out = torch.empty(E * R * G, 2 * B, dtype=dtype, device=blocks.device)  # [N, 32]
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]  # low nibble: even positions
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]  # high nibble: odd positions
    torch.ldexp(out, exp, out=out)  # * 2^(scale - 127), rounded once into dtype
    return out.view(E, R, G * 2 * B).transpose(1, 2).contiguous()  # [E, C, R]
