"""Codecs: what one island puts on the wire for a pseudo-gradient, and how it is read back.

A codec is a final `AbstractCodec` subclass registered under a name (the `compression`
knob): `encode` turns one float tensor into a payload of integer arrays (the bytes that
cross the diloco axis), `decode` turns the payload back into float32, `error_bound` bounds
the error of one value (the tests hold every codec to it), `bits` is the wire width of one
value. Add one with one class and one `register_codec` call.

Built in:
- "none": float32, no codec (the exchange is a float32 all-reduce, not a gather of payloads).
- "bf16": bfloat16, sent as its 16 raw bits.
- "fp8":  float8 e4m3 with a per-tensor float32 scale (max |x| maps to 448).
- "fp4":  E3M0 — a sign bit and 3 exponent bits, no mantissa — with a per-tensor float32
          scale s = max |x|. Code c in 1..7 means ±s·2^(c−7), c = 0 means 0; each value
          rounds to the nearest representable one (ties upward). Two codes per byte.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PyTree, UInt8

from diloco_eqx._registry import Registry

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MIN_EXP = -6  # codes 1..7 are 2^-6 .. 2^0 (times the scale)


class AbstractCodec(eqx.Module):
    """One wire format for pseudo-gradients."""

    bits: eqx.AbstractClassVar[int]
    """Bits one value takes on the wire (per-tensor scales not counted)."""
    lossless: ClassVar[bool] = False
    """True only for "none": the exchange then sums float32 values with an all-reduce."""

    @abc.abstractmethod
    def encode(self, flat: Float[Array, " n"]) -> dict[str, Array]:
        """The payload for a flat, finite float32 tensor (integer arrays only)."""

    @abc.abstractmethod
    def decode(self, payload: dict[str, Array], n: int) -> Float[Array, " n"]:
        """The n float32 values a payload stands for."""

    @abc.abstractmethod
    def error_bound(self, x: Float[Array, "..."]) -> Float[Array, "..."]:
        """An elementwise bound on |decode(encode(x)) − x| for finite x."""

    def payload_bytes(self, n: int) -> int:
        """Bytes of one tensor's payload of n values (override when there is a scale)."""
        return math.ceil(n * self.bits / 8)


def _scale(x: Float[Array, " n"], top: float) -> Float[Array, ""]:
    """max |x| / top, or 1 when x is all zeros (so x / scale stays 0)."""
    m = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), jnp.float32)
    return jnp.where(m > 0, m / top, 1.0).astype(jnp.float32)


class Float32(AbstractCodec):
    bits: ClassVar[int] = 32
    lossless: ClassVar[bool] = True

    def encode(self, flat):
        return {"values": flat}

    def decode(self, payload, n):
        return payload["values"]

    def error_bound(self, x):
        return jnp.zeros_like(jnp.asarray(x, jnp.float32))


class BFloat16(AbstractCodec):
    bits: ClassVar[int] = 16

    def encode(self, flat):
        big = float(jnp.finfo(jnp.bfloat16).max)
        return {"values": lax.bitcast_convert_type(jnp.clip(flat, -big, big).astype(jnp.bfloat16), jnp.uint16)}

    def decode(self, payload, n):
        return lax.bitcast_convert_type(payload["values"], jnp.bfloat16).astype(jnp.float32)

    def error_bound(self, x):
        return jnp.abs(jnp.asarray(x, jnp.float32)) * 2.0**-8


class Float8(AbstractCodec):
    bits: ClassVar[int] = 8

    def encode(self, flat):
        s = _scale(flat, FP8_MAX)
        q = jnp.clip(flat / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        return {"values": lax.bitcast_convert_type(q, jnp.uint8), "scale": s}

    def decode(self, payload, n):
        q = lax.bitcast_convert_type(payload["values"], jnp.float8_e4m3fn).astype(jnp.float32)
        return q * payload["scale"]

    def error_bound(self, x):
        # 3 mantissa bits; below the smallest normal, half the subnormal step
        a = jnp.abs(jnp.asarray(x, jnp.float32))
        m = jnp.max(a) if a.size else 0.0
        return jnp.maximum(a * 2.0**-4, m / FP8_MAX * 2.0**-10) * (1 + 1e-6)

    def payload_bytes(self, n):
        return n + 4


class Float4(AbstractCodec):
    bits: ClassVar[int] = 4

    def encode(self, flat):
        s = _scale(flat, 1.0)
        codes = _fp4_codes(jnp.clip(flat / s, -1.0, 1.0))
        if codes.size % 2:
            codes = jnp.pad(codes, (0, 1))
        pairs = codes.reshape(-1, 2)
        return {"values": pairs[:, 0] | (pairs[:, 1] << 4), "scale": s}

    def decode(self, payload, n):
        v = payload["values"]
        codes = jnp.stack([v & 15, v >> 4], axis=-1).reshape(-1)[:n]
        return _fp4_values(codes) * payload["scale"]

    def error_bound(self, x):
        # between powers of two the worst case is 1.5·2^e -> 1/3 relative; below the
        # smallest code half of it, 2^-7 of the scale
        a = jnp.abs(jnp.asarray(x, jnp.float32))
        m = jnp.max(a) if a.size else 0.0
        return jnp.maximum(a / 3.0, m * 2.0 ** (FP4_MIN_EXP - 1)) * (1 + 1e-6)

    def payload_bytes(self, n):
        return (n + 1) // 2 + 4


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


# ---------------------------------------------------------------- the registry

CODECS: Registry[AbstractCodec] = Registry(
    "codec", "an AbstractCodec instance", lambda c: isinstance(c, AbstractCodec))
for _name, _codec in (("none", Float32()), ("bf16", BFloat16()), ("fp8", Float8()), ("fp4", Float4())):
    CODECS.register(_name, _codec)


def register_codec(name: str, codec: AbstractCodec, *, overwrite: bool = False) -> None:
    """Make `codec` available as `compression=name` (and `--compression name`)."""
    CODECS.register(name, codec, overwrite=overwrite)


registered_codecs = CODECS.names


def get_codec(name: str) -> AbstractCodec:
    """The codec registered as `name`; ValueError naming the knob otherwise."""
    if name not in CODECS:
        raise ValueError(f"compression must be one of {registered_codecs()}; got {name!r}")
    return CODECS[name]


# ---------------------------------------------------------------- by name, one tensor or tree


def check_format(fmt: str) -> str:
    get_codec(fmt)
    return fmt


def bits_per_value(fmt: str) -> int:
    """Bits one parameter takes on the wire (per-tensor scales not counted)."""
    return get_codec(fmt).bits


def payload_bytes(num_values: int, fmt: str) -> int:
    """Bytes of one tensor's payload: packed values plus a 4-byte scale where there is one."""
    return get_codec(fmt).payload_bytes(num_values)


def encode(x: Float[Array, "..."], fmt: str, *, check: bool = True) -> dict[str, Array]:
    """The payload one island sends for tensor x in format `fmt` (integer arrays only).

    With `check`, a NaN or Inf in x raises (eqx.error_if) instead of being sent: a
    non-finite value would poison the per-tensor scale and every value sharing it.
    """
    codec = get_codec(fmt)
    x = jnp.asarray(x, jnp.float32)
    if check:
        x = eqx.error_if(
            x, ~jnp.all(jnp.isfinite(x)), f"compression {fmt!r}: cannot quantize a tensor that holds NaN or Inf"
        )
    return codec.encode(x.reshape(-1))


def decode(payload: dict[str, Array], fmt: str, shape: tuple[int, ...]) -> Float[Array, "..."]:
    """float32 tensor of `shape` from a payload `encode` made."""
    return get_codec(fmt).decode(payload, math.prod(shape)).reshape(shape)


def roundtrip(x: Float[Array, "..."], fmt: str, *, check: bool = True) -> Float[Array, "..."]:
    """decode(encode(x)): the value the other islands see for x."""
    return decode(encode(x, fmt, check=check), fmt, jnp.shape(x))


def error_bound(x: Float[Array, "..."], fmt: str) -> Float[Array, "..."]:
    """An elementwise bound on |roundtrip(x) − x| for finite x."""
    return get_codec(fmt).error_bound(x)


def tree_encode(codec: AbstractCodec, tree: PyTree) -> PyTree:
    """Each leaf's payload (the caller has masked out non-finite islands)."""
    return jax.tree.map(lambda x: codec.encode(jnp.asarray(x, jnp.float32).reshape(-1)), tree)


def tree_decode(codec: AbstractCodec, payload: PyTree, like: PyTree) -> PyTree:
    """float32 leaves shaped like `like`'s from a tree of payloads (None stays None)."""
    return jax.tree.map(lambda x, p: codec.decode(p, x.size).reshape(x.shape), like, payload)
