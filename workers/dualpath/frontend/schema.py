"""What a request body may carry: the pydantic models of `/v1/completions` and
`/v1/chat/completions`, the JSON checks pydantic does not make (depth, text that is not
Unicode) and the fields accepted only at their neutral value (`NOT_SERVED`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dualpath.frontend.errors import ApiError
from dualpath.grpc_bounds import MAX_ID_CHARS

# Deepest JSON a request may nest: the API's own shapes need 3 (messages[i].content).
MAX_JSON_DEPTH = 32
# Most chat messages in one request.
MAX_MESSAGES = 4096
# Most stop strings and stop token ids in one request.
MAX_STOPS = 16


def check_json(obj: Any, path: str = "", depth: int = 0) -> None:
    """Refuse what JSON can carry but the cluster cannot serve: absurd nesting and text that is
    not encodable as UTF-8 (a lone UTF-16 surrogate such as "\\ud800"), naming the field."""
    if depth > MAX_JSON_DEPTH:
        raise ApiError(
            400,
            f"request body nests deeper than {MAX_JSON_DEPTH} levels (at {path or 'the top'})",
            param=path or None,
            code="invalid_json",
        )
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(
                400,
                f"{path or 'body'}: text is not valid Unicode (lone surrogate "
                f"{ascii(err.object[err.start : err.end])} at character {err.start}); "
                "send UTF-8 text or a valid surrogate pair",
                param=path or None,
                code="invalid_text",
            ) from None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            check_json(key, f"{path}.<key>" if path else "<key>", depth + 1)
            check_json(value, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            check_json(value, f"{path}.{i}" if path else str(i), depth + 1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    """A last chunk with `choices: []` and the usage, before `[DONE]` (OpenAI's)."""
    continuous_usage_stats: bool = False
    """The usage so far on every chunk too (vLLM's)."""


class GenerationRequest(BaseModel):
    """What a request may carry. A field not listed is refused (400 naming it), never
    ignored; a listed field the cluster does not serve is refused unless at its neutral value
    (`NOT_SERVED`)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # greedy unless asked (bit-exact answers); OpenAI's default would be 1
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off (vLLM's)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOPS)
    # carried to the scheduler and the workers, whose gRPC bounds every id (grpc_bounds)
    session_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    # as vLLM's: partitions the caller's (its tenant's) cache further; never crosses tenants
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # not served: accepted only at their neutral value (NOT_SERVED)
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)


# Fields clients send that this cluster does not serve, with the values that ask for nothing.
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
}


def refuse_not_served(req: GenerationRequest) -> None:
    for name, neutral in NOT_SERVED.items():
        value = getattr(req, name, None)
        if value is None or value in neutral:
            continue
        raise ApiError(
            400,
            f"{name}={json.dumps(value)} is not served by this cluster (one greedy or sampled "
            f"choice, no log probabilities, no penalties); omit {name} or send "
            f"{json.dumps(neutral[0])}",
            param=name,
            code="unsupported_parameter",
        )
