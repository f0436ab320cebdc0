"""The on-storage block format (pure: no I/O).

A block file is a header padded to `HEADER_ALIGN` bytes, then the payload, layer-major:
layer 0 K | layer 0 V | layer 1 K | layer 1 V | ... Each K (and V) is a contiguous
(block_tokens, heads, dim) array in the model dtype, so reading layer `l` of a block is one
range read at `header_bytes + l * layer_bytes`.

Header (little-endian): magic, format version, dtype code, checksum algorithm, header bytes,
layer count, block tokens, K heads/dim, V heads/dim, model fingerprint, block id, one XXH3-64
checksum per layer (over that layer's K then V bytes), then an XXH3-64 of the header itself.
MLA models store their latent as K (heads 1, dim kv_lora_rank + rope_head_dim) and an empty V.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import xxhash

from dualpath.config import ModelSpec

MAGIC = b"DPKV"
FORMAT_VERSION = 1
HEADER_ALIGN = 4096
CHECKSUM_XXH3_64 = 1
DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3, "float8": 4}
_FIXED = struct.Struct("<4sHBBIIIIIII16s16s")


class BlockFormatError(ValueError):
    """A block that is not a valid block of the expected model; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """Shapes and byte offsets of one model's blocks."""

    layers: int
    block_tokens: int
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    dtype: str
    dtype_bytes: int
    fingerprint: str

    @classmethod
    def from_model(cls, model: ModelSpec) -> BlockLayout:
        if model.attention == "mla":
            k_heads, k_dim, v_heads, v_dim = 1, model.kv_lora_rank + model.rope_head_dim, 1, 0
        else:
            k_heads, k_dim = model.kv_heads, model.head_dim
            v_heads, v_dim = k_heads, k_dim
        return cls(
            layers=model.layers,
            block_tokens=model.block_tokens,
            k_heads=k_heads,
            k_dim=k_dim,
            v_heads=v_heads,
            v_dim=v_dim,
            dtype=model.dtype,
            dtype_bytes=model.dtype_bytes,
            fingerprint=model.fingerprint,
        )

    @property
    def k_token_bytes(self) -> int:
        return self.k_heads * self.k_dim * self.dtype_bytes

    @property
    def v_token_bytes(self) -> int:
        return self.v_heads * self.v_dim * self.dtype_bytes

    @property
    def k_bytes(self) -> int:
        return self.block_tokens * self.k_token_bytes

    @property
    def v_bytes(self) -> int:
        return self.block_tokens * self.v_token_bytes

    @property
    def layer_bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    @property
    def payload_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @cached_property
    def header_bytes(self) -> int:
        raw = _FIXED.size + 8 * self.layers + 8
        return -(-raw // HEADER_ALIGN) * HEADER_ALIGN

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes

    def layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layers})")
        return self.header_bytes + layer * self.layer_bytes

    @property
    def k_shape(self) -> tuple[int, int, int]:
        return (self.block_tokens, self.k_heads, self.k_dim)

    @property
    def v_shape(self) -> tuple[int, int, int]:
        return (self.block_tokens, self.v_heads, self.v_dim)


@dataclass(frozen=True)
class BlockHeader:
    block_id: str
    fingerprint: str
    checksums: tuple[int, ...]


def _shape_fields(layout: BlockLayout) -> tuple[int, ...]:
    """The header's shape fields, in their order in `_FIXED`: written by `encode_header`, and
    what `decode_header` requires a block's to equal."""
    return (
        DTYPE_CODES[layout.dtype],
        layout.header_bytes,
        layout.layers,
        layout.block_tokens,
        layout.k_heads,
        layout.k_dim,
        layout.v_heads,
        layout.v_dim,
    )


def encode_header(layout: BlockLayout, block_id: str, checksums: list[int]) -> bytes:
    if len(checksums) != layout.layers:
        raise ValueError(f"need one checksum per layer ({layout.layers}), got {len(checksums)}")
    dtype, *shape = _shape_fields(layout)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        dtype,
        CHECKSUM_XXH3_64,
        *shape,
        layout.fingerprint.encode(),
        bytes.fromhex(block_id),
    )
    body = fixed + struct.pack(f"<{layout.layers}Q", *checksums)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body + b"\0" * (layout.header_bytes - len(body))


def decode_header(buf: bytes, layout: BlockLayout, block_id: str) -> BlockHeader:
    """Parse and validate a header against the expected layout; raises BlockFormatError."""
    if len(buf) < _FIXED.size:
        raise BlockFormatError("truncated", f"block {block_id}: header shorter than {_FIXED.size}")
    (magic, version, dtype, algo, header_bytes, layers, bt, kh, kd, vh, vd, fp, bid) = (
        _FIXED.unpack_from(buf)
    )
    if magic != MAGIC:
        raise BlockFormatError("bad_header", f"block {block_id}: bad magic {magic!r}")
    if version != FORMAT_VERSION or algo != CHECKSUM_XXH3_64:
        raise BlockFormatError(
            "bad_header", f"block {block_id}: format version {version} / checksum {algo} unknown"
        )
    end = _FIXED.size + 8 * layers
    if layers > 4096 or len(buf) < end + 8:
        raise BlockFormatError("truncated", f"block {block_id}: header cut short")
    (stored,) = struct.unpack_from("<Q", buf, end)
    if xxhash.xxh3_64_intdigest(buf[:end]) != stored:
        raise BlockFormatError("checksum", f"block {block_id}: header checksum mismatch")
    fingerprint = fp.rstrip(b"\0").decode(errors="replace")
    if fingerprint != layout.fingerprint:
        raise BlockFormatError(
            "foreign_model",
            f"block {block_id}: written for model {fingerprint}, expected {layout.fingerprint}",
        )
    if (dtype, header_bytes, layers, bt, kh, kd, vh, vd) != _shape_fields(layout):
        raise BlockFormatError("foreign_model", f"block {block_id}: shape/dtype differ")
    if bid.hex() != block_id:
        raise BlockFormatError("bad_header", f"block {block_id}: header names {bid.hex()}")
    checksums = struct.unpack_from(f"<{layers}Q", buf, _FIXED.size)
    return BlockHeader(block_id=block_id, fingerprint=fingerprint, checksums=tuple(checksums))


def layer_checksum(k: memoryview | bytes, v: memoryview | bytes) -> int:
    h = xxhash.xxh3_64(k)  # XXH3-64 of K then V, streamed (python-xxhash drops the GIL)
    h.update(v)
    return h.intdigest()
