"""Tool calling: OpenAI `tools` / `tool_choice` on chat completions.

- "required" and a named function are enforced with structured outputs: the reply is generated under a JSON schema
  built from the tools' parameters (a list of {"name", "parameters"} for "required"; the function's own parameters
  for a named one), so it always parses.
- "auto" (with --enable-auto-tool-choice) generates freely and a parser for the model family finds the calls in
  the text: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Hermes, Qwen) or `llama3_json`
  (a reply that is `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by `;`).
- The tools reach the model through its chat template (`apply_chat_template(tools=...)`). A template that knows
  nothing of tools (the bundled SmolLM2's) gets them as a Hermes-style system message instead, so the model still
  sees them and the hermes parser reads its calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagekube.engine.sampling_params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str | dict) -> dict:
    """One OpenAI tool call; arguments are a JSON string on the wire."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


# ---- enforcing a call: the schema -----------------------------------------------------------------------------------
def forced_schema(tools: list[dict], tool_choice) -> StructuredOutputsParams | None:
    """The constraint for "required" or a named function; None for "auto" / "none"."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        params = functions[tool_choice["function"]["name"]].get("parameters") or {"type": "object"}
        return StructuredOutputsParams(json=params)
    if tool_choice != "required":
        return None
    one_of = [{"type": "object", "properties": {"name": {"const": name},
                                                 "parameters": f.get("parameters") or {"type": "object"}},
               "required": ["name", "parameters"], "additionalProperties": False}
              for name, f in functions.items()]
    return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": one_of}})


# ---- finding calls in free text: the parsers ----------------------------------------------------------------------
def _json_objects(text: str) -> list[dict] | None:
    """`text` as a sequence of JSON objects (whitespace or `;` between them), or None."""
    decoder, objects, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return objects
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        objects.append(obj)


def _as_call(obj: dict, args_key: str) -> dict | None:
    name, args = obj.get("name"), obj.get(args_key, obj.get("arguments", {}))
    return call(name, args) if isinstance(name, str) and isinstance(args, dict | str) else None


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """(content outside the <tool_call> blocks, calls). A block that does not parse stays in the content."""
    content, calls, rest = [], [], text
    while (start := rest.find("<tool_call>")) != -1:
        end = rest.find("</tool_call>", start)
        body = rest[start + len("<tool_call>"): end if end != -1 else len(rest)]
        objs = _json_objects(body.strip())
        parsed = [c for o in objs or [] if (c := _as_call(o, "arguments"))]
        if not objs or len(parsed) != len(objs):
            break
        content.append(rest[:start])
        calls += parsed
        rest = rest[end + len("</tool_call>"):] if end != -1 else ""
    content.append(rest)
    return "".join(content).strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[dict]]:
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    objs = _json_objects(stripped) if stripped.startswith("{") else None
    calls = [c for o in objs or [] if (c := _as_call(o, "parameters"))]
    if not objs or len(calls) != len(objs):
        return text, []
    return "", calls


def parse(parser: str, text: str) -> tuple[str, list[dict]]:
    return parse_hermes(text) if parser == "hermes" else parse_llama3_json(text)


def start_marker(parser: str) -> tuple[str, ...]:
    """What a reply with calls starts its first call with: streaming holds text back from here on."""
    return ("<tool_call>",) if parser == "hermes" else ("{", "<|python_tag|>")


# ---- one choice's reply, plain or streamed ---------------------------------------------------------------------------
@dataclass
class ToolReply:
    """Turns one choice's generated text into an assistant message (tool calls or content), whole or as deltas."""

    mode: str  # "named" | "required" | "auto"
    parser: str = "hermes"
    function: str | None = None  # for "named"
    text: str = ""
    sent_content: int = 0  # streaming, "auto": chars of text already sent as content
    named_started: bool = False
    held: bool = False  # streaming, "auto": a call may have begun; the rest waits for the finish
    call_id: str = field(default_factory=new_call_id)

    def fresh(self) -> ToolReply:
        """A new reply of the same kind, for one choice (its own call id and stream state)."""
        return ToolReply(self.mode, self.parser, self.function)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole reply: (message, finish_reason)."""
        content, calls = self._calls(text)
        msg = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = calls
        return msg, _finish_reason(bool(calls), finish_reason)

    def _calls(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "named":
            return "", [{"id": self.call_id, "type": "function", "function": {"name": self.function, "arguments": text}}]
        if self.mode == "required":
            try:
                return "", [call(c["name"], c["parameters"]) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # cut off by max_tokens: the text as content, finish "length"
                return text, []
        return parse(self.parser, text)

    def delta(self, new_text: str) -> list[dict]:
        """Deltas for newly generated text (OpenAI stream shape)."""
        self.text += new_text
        if self.mode == "named":  # the reply is the arguments: stream them as they come, after the call's head
            if self.named_started:
                return [{"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}] if new_text else []
            self.named_started = True
            return [{"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                     "function": {"name": self.function, "arguments": new_text}}]}]
        if self.mode == "required" or self.held:
            return []
        # auto: content streams until something that may start a call; the rest waits for the finish
        markers = start_marker(self.parser)
        if self.parser == "llama3_json":  # calls are the whole reply or absent: decide on its first characters
            head = self.text.lstrip()
            if self.sent_content == 0 and (not head or head.startswith(markers)
                                           or any(m.startswith(head) for m in markers)):
                self.held = bool(head) and head.startswith(markers)
                return []
            end = len(self.text)
        else:
            start = self.text.find(markers[0], self.sent_content)
            self.held = start != -1
            end = start if self.held else len(self.text) - _partial_marker_len(self.text, markers)
        out = self.text[self.sent_content:end]
        self.sent_content = max(self.sent_content, end)
        return [{"content": out}] if out else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """Deltas still owed at the end (the calls, or held text), and the finish reason to report."""
        if self.mode == "named":
            return [], _finish_reason(True, finish_reason)
        content, calls = self._calls(self.text)
        deltas = []
        if self.mode == "auto" and not calls:  # no call after all: the held text is content
            rest = self.text[self.sent_content:]
            deltas = [{"content": rest}] if rest else []
        elif self.mode == "auto":
            tail = content[len(self.text[:self.sent_content].strip()):] if content else ""
            deltas = [{"content": tail}] if tail.strip() else []
        elif not calls and self.text:
            deltas = [{"content": self.text}]
        for i, c in enumerate(calls):
            deltas.append({"tool_calls": [{"index": i, **c}]})
        return deltas, _finish_reason(bool(calls), finish_reason)


def _finish_reason(has_calls: bool, finish_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended on its own with calls; "length" etc. stay as they are."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing chars of `text` could begin a marker (held back until the next delta decides)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


# ---- the tools in the prompt -------------------------------------------------------------------------------------------
def template_renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def hermes_system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are listed within "
            f"<tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\nFor each function call, return a JSON object "
            "with the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def without_tool_support(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template with no tool support: the tools in the system message, assistant calls as
    <tool_call> blocks, tool results as <tool_response> blocks (all plain content the template can render)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"
                      for c in m.pop("tool_calls")]
            m["content"] = "\n".join([m.get("content") or "", *blocks]).strip()
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m["content"] = m.get("content") or ""
        out.append(m)
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + hermes_system_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": hermes_system_prompt(tools)})
    return out
