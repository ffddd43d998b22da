"""OpenAI request bodies (plus vLLM's extra sampling fields) and their translation to SamplingParams."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagekube.engine.lora.names import check_adapter_name
from pagekube.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # "schema" would shadow a BaseModel attribute
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object with name and schema')
        return self


# vLLM's older per-kind fields, which many clients still send: field -> StructuredOutputsParams key
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = None  # this and the other sampling ranges: SamplingParams checks them (build_params)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or one of the older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        return v  # empty strings and value ranges: SamplingParams checks them

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k in v or {}:
            if not k.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        if len(self.structured_fields()) > 1:
            raise ValueError(f"give at most one of {', '.join(self.structured_fields())}: each constrains the output")
        return self

    def structured_fields(self) -> list[str]:
        """The fields that ask for structured outputs (a "text" response_format asks for nothing)."""
        given = [f for f in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        return given

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        fields = self.structured_fields()
        if not fields:
            return None
        if fields[0] == "response_format":
            rf = self.response_format
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=rf.json_schema.json_schema)
        if fields[0] == "structured_outputs":
            return self.structured_outputs
        return StructuredOutputsParams(**{GUIDED_FIELDS[fields[0]]: getattr(self, fields[0])})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
        return SamplingParams(
            output_kind=output_kind,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens if max_tokens is None else min(self.min_tokens, max_tokens),
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(),
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and len(v) > 64 and isinstance(v[0], str | list):
            raise ValueError("at most 64 prompts per request")
        return v

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates take it (tool-call arguments as objects, as HF templates expect)."""
        m = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _loads_or_raw(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name:
            m["name"] = self.name
        return m

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


def _loads_or_raw(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools {names}")
        return self

    def effective_tool_choice(self) -> str | dict:
        """"none" without tools; OpenAI's default "auto" with them; a named choice as a dict."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str

    @field_validator("lora_name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_adapter_name(value)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body, plus vLLM's truncate_prompt_tokens and add_special_tokens."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _at_most_2048_inputs(cls, value):
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > 2048:
            raise ValueError(f"{len(value)} inputs: at most 2048 per request")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value):
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's limit) or at least 1")
        return value
