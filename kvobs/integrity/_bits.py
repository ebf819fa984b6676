"""Which bit patterns of each floating-point format are NaN or Inf, as one order-preserving key per element.

Why: reading a value's bits is exact and needs no arithmetic. For every format kvobs checks there is a key
`(bits & mask) ^ flip` (the bits read as an unsigned integer) whose largest values are exactly the
non-finite ones: a block holds a NaN iff its largest key is >= `nan_min`, and a non-finite value iff it is
>= `bad_min`. So one max-reduction per block answers both questions at once.

- IEEE-like formats (fp64, fp32, fp16, bf16, fp8 e5m2): clear the sign; exponent all ones and mantissa zero
  is Inf (exactly `bad_min`), anything above is NaN.
- fp8 e4m3fn: no Inf; NaN is S.1111.111 only.
- fp8 e4m3fnuz / e5m2fnuz: no Inf, no -0; NaN is the single pattern 0x80, which `^ 0x7F` maps to 0xFF.
- fp8 e8m0fnu (an exponent-only scale format): no sign, no Inf; NaN is 0xFF.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NonFiniteBits:
    """The key `(bits & mask) ^ flip` over `width`-byte words: >= bad_min is NaN or Inf, >= nan_min is NaN."""

    width: int
    mask: int
    flip: int
    bad_min: int
    nan_min: int


def _ieee(width: int, exponent_bits: int, mantissa_bits: int) -> NonFiniteBits:
    inf = ((1 << exponent_bits) - 1) << mantissa_bits
    return NonFiniteBits(width, (1 << (8 * width - 1)) - 1, 0, inf, inf + 1)


_BY_NAME = {
    "float64": _ieee(8, 11, 52),
    "float32": _ieee(4, 8, 23),
    "float16": _ieee(2, 5, 10),
    "bfloat16": _ieee(2, 8, 7),
    "float8_e5m2": _ieee(1, 5, 2),
    "float8_e4m3fn": NonFiniteBits(1, 0x7F, 0, 0x7F, 0x7F),
    "float8_e4m3fnuz": NonFiniteBits(1, 0xFF, 0x7F, 0xFF, 0xFF),
    "float8_e5m2fnuz": NonFiniteBits(1, 0xFF, 0x7F, 0xFF, 0xFF),
    "float8_e8m0fnu": NonFiniteBits(1, 0xFF, 0, 0xFF, 0xFF),
}

# Floating-point formats with no NaN or Inf encoding at all: checking them would always pass.
NO_NON_FINITE = ("float4_e2m1fn_x2",)


@functools.cache
def non_finite_bits(dtype: Any) -> NonFiniteBits | None:
    """The bit rule for a torch dtype, or None for one that holds no NaN/Inf (or that kvobs does not know)."""
    return _BY_NAME.get(str(dtype).removeprefix("torch."))


def lane_test(bits: NonFiniteBits) -> tuple[int, int, int, int, int]:
    """(xor, ones, low, keep, top): a test of 64-bit words holding 8 / width values ("lanes") at once.

    With y = word ^ xor, the top bit of each lane of `((y & ones) + low) & (y | keep)` is set exactly when
    that lane is NaN or Inf (no carry crosses lanes: `ones + low` is at most the lane's top bit). ORing the
    results of all words and testing `top` finds a bad piece in three operations per word for the common
    formats; only a bad piece is then read element by element for the exact verdict.
    - sign ignored (IEEE-like formats, e4m3fn): `ones` is the all-ones field (`bad_min`: the exponent, or
      the 7 low bits of e4m3fn); adding its lowest bit carries into the sign position exactly when every bit
      of the field is set; keep = top lets the sign be anything.
    - one NaN pattern (fnuz, e8m0): y = value ^ flip is all ones exactly for NaN; ones = the bits below the
      top, low = 1, keep = 0 so that the top bit of y must be set too.
    """
    lanes = 8 // bits.width
    top = 1 << (8 * bits.width - 1)
    if bits.mask == top - 1 and bits.flip == 0:
        ones = bits.bad_min
        low = bits.bad_min & -bits.bad_min
        keep = top
    else:
        ones = top - 1
        low = 1
        keep = 0
    spread = sum(1 << (8 * bits.width * i) for i in range(lanes))  # 0x0001000100010001 for 2-byte lanes
    return bits.flip * spread, ones * spread, low * spread, keep * spread, top * spread
