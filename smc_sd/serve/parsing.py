"""A completion request's JSON body read into what the engine runs: prompts as token ids, the
program module with its options and schedule (judged by the CLI's own `check_program`), the
seeds of the n choices, stop strings and the streaming options.

Both endpoints read the OpenAI fields (`model`, `max_tokens` / `max_completion_tokens`,
`temperature`, `seed`, `n`, `stop`, `stream`, `stream_options`, `response_format`) and vLLM's
`structured_outputs`; /v1/chat/completions reads `messages` (rendered by the tokenizer's chat
template), /v1/completions `prompt` (text, token ids, or a list of either). The SMC settings ride
in the body under the CLI's names: `method`, `particles`, `draft_len`, `draft_temperature`,
`ess_threshold`, `alpha`, `resampling`; `return_particles` adds every particle to the answer.
`draft` chooses what proposes for sd, smc-sd and mask-at-verify: `free` (no model: tokens the
constraints force and continuations found in the prompt and the text; every server has it) or
the name of a draft the server loaded (`--draft`). Without it a request with a structured output
(`response_format`, `structured_outputs`) takes the free draft, whose forced tokens cost nothing
(except smc-sd on a backend whose rows keep one length), and any other request the server's
first `--draft`.

Choice i of a request with seed s runs with seed s + i (as vLLM does for n > 1); without a seed
the server draws one and reports it in each choice's `smc.seed`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

from smc_sd.drafts import FREE, parse_draft
from smc_sd.program import Schedule
from smc_sd.serve.errors import bad_request, unknown_model
from smc_sd.serve.fields import ARRAY, BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, check_fields, read, shown
from smc_sd.serve.structured import constraint_potentials

#: choices one request may ask for (n times the prompts)
MAX_CHOICES = 128
#: generated tokens per choice when the body gives neither max_tokens nor max_completion_tokens
DEFAULT_MAX_TOKENS = 128
#: the SMC settings a body may carry, as (field, kind)
SMC_FIELDS = (("method", STRING), ("particles", INTEGER), ("draft_len", INTEGER), ("draft_temperature", NUMBER),
              ("ess_threshold", NUMBER), ("alpha", NUMBER), ("resampling", STRING))
#: the CLI's defaults of the settings that have one (particles, draft_len, draft_temperature: the method's)
SMC_DEFAULTS = {"method": "smc-sd", "ess_threshold": 0.5, "alpha": 1.0, "resampling": "systematic"}
COMMON = {"model", "max_tokens", "temperature", "seed", "n", "stop", "stream", "stream_options",
          "response_format", "structured_outputs", "json_layout", "return_particles", "draft", *(name for name, _ in SMC_FIELDS)}
SUPPORTED = {"chat": COMMON | {"messages", "max_completion_tokens"}, "completion": COMMON | {"prompt"}}
#: fields not implemented, with the values that leave the output unchanged
COMMON_NEUTRAL = {"top_p": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
                  "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,)}
NEUTRAL = {
    "chat": COMMON_NEUTRAL | {"logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",),
                              "parallel_tool_calls": (False, True), "functions": ([],)},
    "completion": COMMON_NEUTRAL | {"logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",)},
}
#: fields that do not change the output
IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
CHAT_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ServedModel:
    """What parsing needs of the served target: its name, tokenizer and vocabulary size V, and
    the drafts the server loaded (names as `--draft` gave them; none when it serves the free
    draft alone), and the default of requests that name none (None: the first loaded, else
    free)."""

    name: str
    tokenizer: object
    vocabulary_size: int
    drafts: tuple[str, ...] = ()
    default: str | None = None

    @property
    def default_draft(self) -> str:
        """The draft of a request that names none and has no structured output."""
        return self.default or (self.drafts[0] if self.drafts else FREE)

    def served_drafts(self) -> str:
        """The drafts a request may name, for messages."""
        return ", ".join((FREE, *self.drafts))


@dataclass(frozen=True)
class Parsed:
    """One request body, judged.

    Attributes:
        endpoint: "chat" or "completion".
        method: the program's name ("ar", "sd", "smc-sd", "mask-at-verify").
        draft: the draft it runs with ("free" or a loaded draft's name; None for ar).
        prompts: prompt token ids, one list per prompt (chat: one).
        module: the program module (`smc_sd.programs.get(method)`).
        options: the keyword options of `module.program`, constraints included.
        schedule: particles, ESS threshold, resampling, max tokens.
        seeds: the seed of each of the n choices of every prompt (seed + i).
        stop: stop strings.
        stream: answer as server-sent events.
        include_usage: streaming: end with a chunk carrying the token counts.
        return_particles: every choice's smc object lists every particle.
    """

    endpoint: str
    method: str
    draft: str | None
    prompts: list[list[int]]
    module: ModuleType
    options: dict
    schedule: Schedule
    seeds: list[int]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_particles: bool

    @property
    def cut_at(self) -> tuple[str, ...]:
        """The stop strings a choice's text is cut before: all of them, except under a
        structured output, whose text keeps its stop string (it is part of the constrained
        text the engine checked complete: `smc_sd.engine.groups`)."""
        return () if self.options.get("constraints") else self.stop


def spell(name: str) -> str:
    """How messages name a setting: the body field (max_new_tokens is max_tokens here)."""
    return "max_tokens" if name == "max_new_tokens" else name


def parse(body, endpoint: str, model: ServedModel) -> Parsed:
    """Read and judge a request body for `endpoint` ("chat" or "completion").

    Raises:
        APIError: 400 naming the field for bad input; 404 for a model this server does not serve.
    """
    from smc_sd.settings import check_program

    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {shown(body)}")
    check_fields(body, SUPPORTED[endpoint], NEUTRAL[endpoint], IGNORED)
    name = read(body, "model", STRING)
    if name is None:
        raise bad_request("model is required", "model")
    if name != model.name:
        raise unknown_model(name, model.name)
    prompts = [chat_prompt(body, model.tokenizer)] if endpoint == "chat" else completion_prompts(body, model)
    n = read(body, "n", INTEGER, 1)
    if n < 1:
        raise bad_request(f"n must be >= 1, got {n}", "n")
    if n * len(prompts) > MAX_CHOICES:
        raise bad_request(f"n times the prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}", "n")
    seed = read(body, "seed", INTEGER)
    seed = secrets.randbits(63) if seed is None else seed
    stream = read(body, "stream", BOOLEAN, False)
    stream_options = read(body, "stream_options", OBJECT)
    if stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream true", "stream_options")
    include_usage = read(stream_options or {}, "include_usage", BOOLEAN, False, "stream_options.include_usage")
    settings = SimpleNamespace(
        **{field: read(body, field, kind) for field, kind in SMC_FIELDS},
        temperature=read(body, "temperature", NUMBER, 1.0), seed=seed, max_new_tokens=max_tokens(body),
    )
    for field, default in SMC_DEFAULTS.items():
        if getattr(settings, field) is None:
            setattr(settings, field, default)
    constraints = constraint_potentials(body)
    settings.draft = request_draft(body, settings.method, bool(constraints), model)
    try:
        module, options, schedule = check_program(settings, constraints, spell)
    except ValueError as error:
        raise bad_request(" ".join(str(error).split())) from None
    if seed + n - 1 >= 2**64:
        raise bad_request(f"seed + n - 1 must be < 2^64, got {seed} + {n - 1}", "seed")
    return Parsed(endpoint, settings.method, settings.draft, prompts, module, options, schedule, [seed + i for i in range(n)], stop_strings(body),
                  stream, include_usage, read(body, "return_particles", BOOLEAN, False))


def request_draft(body: dict, method: str, structured: bool, model: ServedModel) -> str | None:
    """The draft a request runs with (module docstring); None for a method that drafts nothing.

    Raises:
        APIError: 400 for a draft with ar, or a draft the server has not loaded (naming the
            loaded ones).
    """
    from smc_sd.drafts import model_count

    draft = read(body, "draft", STRING)
    if model_count(SimpleNamespace(method=method)) == 1:
        if draft is not None:
            raise bad_request(f"method {method} drafts nothing; drop draft", "draft")
        return None
    if draft is None:
        return FREE if structured else model.default_draft
    try:
        choice = parse_draft(draft)
    except ValueError as error:
        raise bad_request(f"draft {shown(draft)}: {error}", "draft") from None
    if choice.has_lm and choice.lm not in model.drafts:
        raise bad_request(f"draft {shown(draft)} is not loaded on this server; it serves {model.served_drafts()}", "draft", "draft_not_loaded")
    return draft


def max_tokens(body: dict) -> int:
    """The token budget per choice: max_completion_tokens or max_tokens (equal if both given)."""
    given = {name: read(body, name, INTEGER) for name in ("max_tokens", "max_completion_tokens")}
    given = {name: value for name, value in given.items() if value is not None}
    if len(set(given.values())) > 1:
        raise bad_request(f"max_tokens and max_completion_tokens differ ({given['max_tokens']} and "
                          f"{given['max_completion_tokens']}); give one", "max_tokens")
    return next(iter(given.values()), DEFAULT_MAX_TOKENS)


def stop_strings(body: dict) -> tuple[str, ...]:
    """`stop`: a string or an array of non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"stop must be a non-empty string or an array of them, got {shown(stop)}", "stop")
    return tuple(stops)


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """The messages rendered by the tokenizer's chat template, ready for the assistant's reply."""
    messages = read(body, "messages", ARRAY)
    if not messages:
        raise bad_request("messages must be a non-empty array of {role, content} objects", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("the served model's tokenizer has no chat template; use /v1/completions", "messages")
    plain = [chat_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    try:
        encoded = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except Exception as error:  # the template's own refusals (jinja raise_exception) come as several types
        raise bad_request(f"the chat template refused the messages: {' '.join(str(error).split())}", "messages") from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(token) for token in ids]


def chat_message(message, param: str) -> dict:
    """One message as {"role", "content": text}; text parts of a content array are joined."""
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object with role and content, got {shown(message)}", param)
    extra = sorted(set(message) - {"role", "content", "name"})
    if extra:
        raise bad_request(f"{param}.{extra[0]} is not supported (messages carry role and content)", f"{param}.{extra[0]}")
    role = read(message, "role", STRING, param=f"{param}.role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}", f"{param}.role")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
            raise bad_request(f"{param}.content parts must be {{type: text, text: ...}} (text only)", f"{param}.content")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or an array of text parts, got {shown(content)}", f"{param}.content")
    return {"role": role, "content": content}


def completion_prompts(body: dict, model: ServedModel) -> list[list[int]]:
    """`prompt` as token-id lists: a string, an array of token ids, or an array of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_token(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a string, an array of token ids, or a non-empty array of either", "prompt")
    out = []
    for i, one in enumerate(prompt):
        if isinstance(one, str):
            ids = model.tokenizer.encode(one)
        elif isinstance(one, list) and all(is_token(t) for t in one):
            ids = one
        else:
            raise bad_request(f"prompt[{i}] must be a string or an array of token ids, got {shown(one)}", "prompt")
        if not ids:
            raise bad_request(f"prompt[{i}] is empty; give at least one token", "prompt")
        if not all(0 <= t < model.vocabulary_size for t in ids):
            raise bad_request(f"prompt[{i}] holds a token id outside 0 .. {model.vocabulary_size - 1}", "prompt")
        out.append([int(t) for t in ids])
    return out


def is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
