"""Compressed pseudo-gradients: what one island puts on the wire, and how it is read back.

Formats (the `compression` knob):
- "none": float32, no codec (the exchange is a float32 all-reduce).
- "bf16": bfloat16, sent as its 16 raw bits.
- "fp8":  float8 e4m3 with a per-tensor float32 scale (max |x| maps to 448).
- "fp4":  E3M0 — a sign bit and 3 exponent bits, no mantissa — with a per-tensor float32
          scale s = max |x|. Code c in 1..7 means ±s·2^(c−7), c = 0 means 0; each value
          rounds to the nearest representable one. Two codes are packed per byte.

`encode` returns a payload of integer arrays (the bytes that cross the diloco axis);
`decode` turns a payload back into float32. Every format keeps the error of one value
within a bound `error_bound` states, which the tests check.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PyTree, UInt8

FORMATS = ("none", "bf16", "fp8", "fp4")

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MIN_EXP = -6  # codes 1..7 are 2^-6 .. 2^0 (times the scale)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"compression must be one of {FORMATS}; got {fmt!r}")
    return fmt


def bits_per_value(fmt: str) -> int:
    """Bits one parameter takes on the wire (per-tensor scales not counted)."""
    return {"none": 32, "bf16": 16, "fp8": 8, "fp4": 4}[check_format(fmt)]


def _scale(x: Float[Array, "..."], top: float) -> Float[Array, ""]:
    """max |x| / top, or 1 when x is all zeros (so x / scale stays 0)."""
    m = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), jnp.float32)
    return jnp.where(m > 0, m / top, 1.0).astype(jnp.float32)


def _fp4_codes(y: Float[Array, " n"]) -> UInt8[Array, " n"]:
    """4-bit E3M0 codes of y with |y| <= 1 (sign in bit 3, exponent code in bits 0-2)."""
    a = jnp.abs(y)
    e_lo = jnp.floor(jnp.log2(jnp.maximum(a, 2.0**-30)))
    e = e_lo + (a >= 1.5 * jnp.exp2(e_lo))  # nearest of 2^e_lo, 2^(e_lo+1); ties go up
    c = jnp.clip(e - FP4_MIN_EXP + 1, 0, 7)
    c = jnp.where(e < FP4_MIN_EXP, jnp.where(a >= 2.0 ** (FP4_MIN_EXP - 1), 1, 0), c)
    sign = (y < 0) & (c > 0)
    return (c.astype(jnp.uint8) | (sign.astype(jnp.uint8) << 3)).astype(jnp.uint8)


def _fp4_values(codes: UInt8[Array, " n"]) -> Float[Array, " n"]:
    c = (codes & 7).astype(jnp.float32)
    mag = jnp.where(c > 0, jnp.exp2(c - 1 + FP4_MIN_EXP), 0.0)
    return jnp.where(codes & 8, -mag, mag)


def encode(x: Float[Array, "..."], fmt: str, *, check: bool = True) -> PyTree:
    """The payload one island sends for tensor x in format `fmt` (integer arrays only).

    With `check`, a NaN or Inf in x raises (eqx.error_if) instead of being sent: a
    non-finite value would poison the per-tensor scale and every value sharing it.
    """
    fmt = check_format(fmt)
    x = jnp.asarray(x, jnp.float32)
    if check:
        x = eqx.error_if(
            x,
            ~jnp.all(jnp.isfinite(x)),
            f"compression {fmt!r}: cannot quantize a tensor that holds NaN or Inf",
        )
    flat = x.reshape(-1)
    if fmt == "none":
        return {"values": flat}
    if fmt == "bf16":
        big = float(jnp.finfo(jnp.bfloat16).max)
        q = jnp.clip(flat, -big, big).astype(jnp.bfloat16)
        return {"values": lax.bitcast_convert_type(q, jnp.uint16)}
    if fmt == "fp8":
        s = _scale(flat, FP8_MAX)
        q = jnp.clip(flat / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        return {"values": lax.bitcast_convert_type(q, jnp.uint8), "scale": s}
    s = _scale(flat, 1.0)
    codes = _fp4_codes(jnp.clip(flat / s, -1.0, 1.0))
    if codes.size % 2:
        codes = jnp.pad(codes, (0, 1))
    pairs = codes.reshape(-1, 2)
    return {"values": pairs[:, 0] | (pairs[:, 1] << 4), "scale": s}


def decode(payload: PyTree, fmt: str, shape: tuple[int, ...]) -> Float[Array, "..."]:
    """float32 tensor of `shape` from a payload `encode` made."""
    fmt = check_format(fmt)
    v = payload["values"]
    n = 1
    for d in shape:
        n *= d
    if fmt == "none":
        out = v
    elif fmt == "bf16":
        out = lax.bitcast_convert_type(v, jnp.bfloat16).astype(jnp.float32)
    elif fmt == "fp8":
        out = lax.bitcast_convert_type(v, jnp.float8_e4m3fn).astype(jnp.float32) * payload["scale"]
    else:
        codes = jnp.stack([v & 15, v >> 4], axis=-1).reshape(-1)[:n]
        out = _fp4_values(codes) * payload["scale"]
    return out.reshape(shape)


def roundtrip(x: Float[Array, "..."], fmt: str, *, check: bool = True) -> Float[Array, "..."]:
    """decode(encode(x)): the value the other islands see for x."""
    return decode(encode(x, fmt, check=check), fmt, jnp.shape(x))


def error_bound(x: Float[Array, "..."], fmt: str) -> Float[Array, "..."]:
    """An elementwise bound on |roundtrip(x) − x| for finite x (tests hold the codecs to it)."""
    a = jnp.abs(jnp.asarray(x, jnp.float32))
    m = jnp.max(a) if a.size else 0.0
    if fmt == "none":
        return jnp.zeros_like(a)
    if fmt == "bf16":
        return a * 2.0**-8
    if fmt == "fp8":  # 3 mantissa bits; below the smallest normal, half the subnormal step
        return jnp.maximum(a * 2.0**-4, m / FP8_MAX * 2.0**-10) * (1 + 1e-6)
    # fp4: between powers of two the worst case is 1.5·2^e -> 1/3 relative; below the
    # smallest code half of it, 2^-7 of the scale
    return jnp.maximum(a / 3.0, m * 2.0 ** (FP4_MIN_EXP - 1)) * (1 + 1e-6)


def payload_bytes(num_values: int, fmt: str) -> int:
    """Bytes of one tensor's payload: packed values plus a 4-byte scale where there is one."""
    fmt = check_format(fmt)
    if fmt == "fp4":
        return (num_values + 1) // 2 + 4
    return num_values * bits_per_value(fmt) // 8 + (4 if fmt == "fp8" else 0)


def tree_encode(tree: PyTree, fmt: str, *, check: bool = True) -> PyTree:
    return jax.tree.map(lambda x: encode(x, fmt, check=check), tree)


def tree_decode(payload: PyTree, fmt: str, like: PyTree) -> PyTree:
    """Decode a tree of payloads into float32 leaves shaped like `like`'s (None stays None)."""
    return jax.tree.map(lambda x, p: decode(p, fmt, x.shape), like, payload)
