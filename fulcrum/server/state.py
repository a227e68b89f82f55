"""What every handler works with: the engine, the served model's name, the key, the metrics, and the
translation of a request's fields into the engine's terms (prompt ids, SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.defaults import DEFAULT_MAX_BODY_MB
from fulcrum.engine.async_llm import AsyncLLM
from fulcrum.engine.multimodal import ImageInput
from fulcrum.engine.structured import validate
from fulcrum.errors import InvalidRequestError, ModelNotFoundError
from fulcrum.protocol import ChatMessage, SamplingFields
from fulcrum.sampling_params import SamplingParams, StructuredOutputsParams
from fulcrum.server.images import message_images
from fulcrum.server.metrics import ServerMetrics
from fulcrum.utils.tokenizer import chat_prompt_ids


@dataclass
class ServerState:
    engine: AsyncLLM
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    draining: bool = False  # SIGTERM: requests in flight finish, new ones get 503
    tool_call_parser: str | None = None  # --tool-call-parser: how the model writes tool calls
    reasoning_parser: str | None = None  # --reasoning-parser: how a reasoning model marks its thought
    allowed_origins: list[str] = field(default_factory=list)  # --allowed-origins: browsers' origins (CORS); none: off
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)  # --max-request-body-mb: larger bodies get 413
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapters served, by name -> their folder

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name nobody serves."""
        if name is None or name == self.model_name:
            return None
        if name in self.loras:
            return name
        raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model")

    def chat_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The prompt's token ids, for a route that takes no images."""
        for i, m in enumerate(messages):
            if images := m.image_urls():
                field = f"messages[{i}].content[{images[0][0]}]"
                raise InvalidRequestError(f"{field}: images are taken by /v1/chat/completions only", field)
        return self.chat_prompt(messages, add_generation_prompt, tools, template_kwargs)[0]

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], ImageInput | None]:
        """The prompt's token ids and, when the messages carry images, their ImageInput (the ids' image tokens
        expanded for them)."""
        raw, fields = message_images(messages)
        prompter = self.engine.image_prompts(fields[0]) if raw else None
        placeholder = prompter.placeholder if prompter else ""
        convo = [m.for_template(placeholder) for m in messages]
        try:
            ids = chat_prompt_ids(self.engine.tokenizer, convo, add_generation_prompt, tools, template_kwargs)
        except Exception as e:  # template errors (e.g. a role the template refuses) are the client's
            raise InvalidRequestError(f"messages cannot be rendered by the chat template: {e}", "messages") from e
        if prompter is None:
            return ids, None
        return prompter(ids, raw, "messages", fields)


def sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """A request's sampling fields as SamplingParams (OpenAI's defaults where a field is absent)."""
    try:
        logit_bias = req.logit_bias_ids()
    except ValueError as e:
        raise InvalidRequestError(str(e), param="logit_bias") from e
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=logit_bias,
        structured_outputs=structured_outputs(req),
    )


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, whichever of OpenAI's or vLLM's fields it uses."""
    asked: dict[str, dict] = {}
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif rf is not None and rf.type == "json_schema":
        asked["response_format"] = {"json": rf.json_schema.schema_}
    if req.structured_outputs is not None:
        so = req.structured_outputs
        asked["structured_outputs"] = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": bool(so.json_object),
            "structural_tag": so.structural_tag,
            "disable_any_whitespace": so.disable_any_whitespace,
        }
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
        ("structural_tag", "structural_tag"),
    ):
        if getattr(req, name) is not None:
            asked[name] = {key: getattr(req, name)}
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequestError(f"give one output constraint, not {' and '.join(asked)}", param=next(iter(asked)))
    ((name, spec),) = asked.items()
    if isinstance(spec.get("json"), bool):  # the schemas `true` and `false`
        spec["json"] = "true" if spec["json"] else "false"
    try:
        params = StructuredOutputsParams(**spec)
        validate(params)  # the engine checks again; here a 400 can name the request's field
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e), param=name) from None
    return params
