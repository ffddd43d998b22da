"""SamplingParams: how one request's tokens are chosen (vLLM's names and defaults)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output: streaming
    FINAL_ONLY = 2  # one output, when the request finishes: non-streaming and LLM.generate


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's names): exactly one of a JSON schema, any JSON object, a regex,
    one of a list of strings, or an EBNF grammar (GBNF, as llama.cpp and xgrammar write it). A dataclass, as in
    vLLM: a pydantic model could not have a field named `json`."""

    json: dict | str | None = None  # a JSON schema (object or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if len(self._given()) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, grammar (got {self._given() or 'none'})")
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")

    def _given(self) -> list[str]:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return given + ["json_object"] if self.json_object else given

    @property
    def kind(self) -> str:
        return self._given()[0]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=100.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = Field(16, ge=1)  # None: up to max_model_len
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)  # top-k logprobs per generated token
    logit_bias: dict[int, float] = Field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v):
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        for tok, bias in v.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {tok} must be in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
