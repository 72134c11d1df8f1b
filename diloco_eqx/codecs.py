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
- "topk": SparseLoCo's chunked top-k (`TopK`): per chunk of `chunk` values the
          round(density·chunk) largest in magnitude, `bits`-bit uniform codes on [−m, m]
          (m: that chunk's largest), their uint16 positions and a float32 m per chunk;
          every other value arrives as 0. DiLoCoConfig builds it from the topk_* knobs.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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

    def index_bytes(self, n: int) -> int:
        """The part of `payload_bytes(n)` that says where the values go (0: a dense codec,
        which sends every value in order)."""
        return 0


def _scale(x: Float[Array, " n"], top: float) -> Float[Array, ""]:
    """max |x| / top, or 1 when x is all zeros (so x / scale stays 0).

    Written as max |x| times the float32 reciprocal of `top`: under jit XLA turns a division
    by a constant into that product, so this form gives the same scale compiled or not."""
    m = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), jnp.float32)
    return jnp.where(m > 0, m * np.float32(1.0 / top), 1.0).astype(jnp.float32)


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


TOPK_BITS = (1, 2, 4, 8)  # code widths that pack whole codes into a byte
TOPK_MAX_CHUNK = 65536  # positions within a chunk travel as uint16


class TopK(AbstractCodec):
    """SparseLoCo's chunked top-k with `bits`-bit values (Sarfi et al. 2025).

    A tensor of n values is cut into chunks of c = min(chunk, n) (the last one padded with
    zeros); each chunk sends its k = max(1, round(density·c)) values of largest magnitude
    (`lax.top_k` of |x|: on equal magnitudes the lower position wins; round() is Python's,
    half to even). They are quantized to L = 2**bits levels spread evenly over [−m, m],
    m = the chunk's largest |x| (level j = m·(2j − (L−1))/(L−1), j = 0..L−1): each value
    takes the nearest level, ties to the even j as jnp.round does. The level index starts
    as round((x/m + 1)·(L−1)/2) and moves one level where x lies beyond a midpoint
    m·(2j ± 1 − (L−1))/(L−1), so a value tiny next to m keeps its sign (x/m + 1 would round
    to exactly 1, a tie). There is no 0 level: a selected 0 arrives as +m/(L−1) (−m with
    bits = 1), which only happens in a chunk with fewer than k nonzero values.

    Payload: "values" (uint8, the k·(number of chunks) codes packed 8/bits per byte, first
    code in the low bits), "indices" (uint16 (chunks, k), positions within each chunk),
    "scale" (float32 (chunks,), m). Decoding scatters the levels into zeros and drops the
    padding. `bits` here is the width of one sent value's code; what a tensor costs on the
    wire is `payload_bytes(n)` (values, indices and scales), of which `index_bytes(n)` are
    the indices.
    """

    density: float = 0.03
    """Fraction of each chunk's values sent, in (0, 1]."""
    chunk: int = 4096
    """Values per chunk, 1..65536."""
    bits: int = 2
    """Bits of one sent value's code: 1, 2, 4 or 8."""

    def __init__(self, density: float = 0.03, chunk: int = 4096, bits: int = 2):
        # written out so the positional order is (density, chunk, bits): as a field that
        # fills AbstractCodec's `bits`, bits would otherwise come first
        self.density, self.chunk, self.bits = density, chunk, bits

    def __check_init__(self):
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) or not 0 < self.density <= 1:
            raise ValueError(f"TopK density must be a number in (0, 1]; got {self.density!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 1 <= self.chunk <= TOPK_MAX_CHUNK:
            raise ValueError(f"TopK chunk must be an integer in 1..{TOPK_MAX_CHUNK}; got {self.chunk!r}")
        if isinstance(self.bits, bool) or self.bits not in TOPK_BITS:
            raise ValueError(f"TopK bits must be one of {TOPK_BITS}; got {self.bits!r}")

    def layout(self, n: int) -> tuple[int, int, int]:
        """(chunk size c, number of chunks, values sent per chunk k) for a tensor of n values."""
        c = max(1, min(self.chunk, n))
        return c, -(-n // c), max(1, round(self.density * c))

    def _ratios(self) -> tuple[Array, Array]:
        """The levels and the midpoints between neighbours, as multiples of m: float32
        constants, each one correctly rounded quotient (made with NumPy, not left to XLA,
        which may divide by a constant as a multiplication by its reciprocal)."""
        top = 2**self.bits - 1
        levels = np.float32(2 * np.arange(top + 1) - top) / np.float32(top)
        mids = np.float32(2 * np.arange(top) + 1 - top) / np.float32(top)
        return jnp.asarray(levels), jnp.asarray(mids)

    def encode(self, flat):
        n = flat.shape[0]
        c, chunks, k = self.layout(n)
        rows = jnp.pad(flat, (0, chunks * c - n)).reshape(chunks, c)
        _, idx = lax.top_k(jnp.abs(rows), k)
        sel = jnp.take_along_axis(rows, idx, axis=1)
        m = jnp.max(jnp.abs(sel), axis=1, initial=0.0)
        top = 2**self.bits - 1
        _, mids = self._ratios()
        u = sel / jnp.where(m > 0, m, 1.0)[:, None]
        j = jnp.clip(jnp.round((u + 1.0) * (top / 2)), 0, top).astype(jnp.int32)
        # one level down or up where x is past the midpoint (a tie goes to the even j)
        lo = m[:, None] * mids[jnp.clip(j - 1, 0, top - 1)]
        hi = m[:, None] * mids[jnp.clip(j, 0, top - 1)]
        odd = (j % 2) == 1
        down = (j > 0) & ((sel < lo) | ((sel == lo) & odd))
        up = (j < top) & ((sel > hi) | ((sel == hi) & odd))
        codes = (j - down.astype(jnp.int32) + up.astype(jnp.int32)).astype(jnp.uint8).reshape(-1)
        per = 8 // self.bits
        codes = jnp.pad(codes, (0, -codes.size % per)).reshape(-1, per)
        shifts = jnp.arange(per, dtype=jnp.uint8) * self.bits
        packed = jnp.sum(codes.astype(jnp.uint32) << shifts.astype(jnp.uint32)[None], axis=1).astype(jnp.uint8)
        return {"values": packed, "indices": idx.astype(jnp.uint16), "scale": m.astype(jnp.float32)}

    def decode(self, payload, n):
        c, chunks, k = self.layout(n)
        per = 8 // self.bits
        shifts = jnp.arange(per, dtype=jnp.uint8) * self.bits
        codes = (payload["values"][:, None] >> shifts[None]) & jnp.uint8(2**self.bits - 1)
        codes = codes.reshape(-1)[: chunks * k].reshape(chunks, k).astype(jnp.int32)
        levels, _ = self._ratios()
        vals = payload["scale"][:, None] * levels[codes]
        idx = payload["indices"].astype(jnp.int32)
        out = jnp.zeros((chunks, c), jnp.float32).at[jnp.arange(chunks)[:, None], idx].set(vals)
        return out.reshape(-1)[:n]

    def error_bound(self, x):
        # an unsent value arrives as 0 (error |x|); a sent one is at most half a level step,
        # m_chunk/(L−1) <= M/(L−1) with M the tensor's largest |x|, off its level (plus the
        # float32 rounding of m·level and of the midpoints: far below 1e-6·M)
        a = jnp.abs(jnp.asarray(x, jnp.float32))
        m = jnp.max(a) if a.size else 0.0
        return jnp.maximum(a, m / (2**self.bits - 1)) + m * 1e-6

    def payload_bytes(self, n):
        if n == 0:
            return 0
        _, chunks, k = self.layout(n)
        return math.ceil(chunks * k * self.bits / 8) + self.index_bytes(n) + 4 * chunks

    def index_bytes(self, n):
        if n == 0:
            return 0
        _, chunks, k = self.layout(n)
        return 2 * chunks * k


# ---------------------------------------------------------------- the registry

CODECS: Registry[AbstractCodec] = Registry(
    "codec", "an AbstractCodec instance", lambda c: isinstance(c, AbstractCodec))
for _name, _codec in (("none", Float32()), ("bf16", BFloat16()), ("fp8", Float8()), ("fp4", Float4()),
                      ("topk", TopK())):
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
    """Bits one parameter takes on the wire (per-tensor scales not counted); for a sparse
    codec such as "topk", of each value it sends (its payload_bytes counts what it sends)."""
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
