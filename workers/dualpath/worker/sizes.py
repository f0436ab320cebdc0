"""The sizes of a request's two KV regions (pure: the wire checks a request's regions with
them before the worker takes any; `layout.RequestLayout` adds the torch views)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from dualpath.config import ModelSpec
from dualpath.kv.format import BlockLayout


@dataclass(frozen=True)
class RequestSizes:
    """The sizes of one request's KV regions: `hit_blocks` from storage, `new_tokens` computed."""

    block: BlockLayout
    hit_blocks: int
    new_tokens: int

    @classmethod
    def of(cls, model: ModelSpec, hit_tokens: int, prompt_tokens: int) -> Self:
        if hit_tokens % model.block_tokens:
            raise ValueError(
                f"hit_tokens ({hit_tokens}) must be whole blocks of {model.block_tokens}"
            )
        if not 0 <= hit_tokens < prompt_tokens:
            raise ValueError(
                f"hit_tokens ({hit_tokens}) must leave at least one of the {prompt_tokens} "
                "prompt tokens to prefill"
            )
        return cls(
            BlockLayout.from_model(model),
            hit_tokens // model.block_tokens,
            prompt_tokens - hit_tokens,
        )

    @property
    def layers(self) -> int:
        return self.block.layers

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block.block_tokens

    @property
    def hit_layer_bytes(self) -> int:
        return self.hit_blocks * self.block.layer_bytes

    @property
    def hit_bytes(self) -> int:
        return self.hit_layer_bytes * self.layers

    @property
    def new_k_bytes(self) -> int:
        return self.new_tokens * self.block.k_token_bytes

    @property
    def new_layer_bytes(self) -> int:
        return self.new_tokens * (self.block.k_token_bytes + self.block.v_token_bytes)

    @property
    def new_bytes(self) -> int:
        return self.new_layer_bytes * self.layers
