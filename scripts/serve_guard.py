"""The request checks scripts/serve_openai_api.py puts in front of transformers' serve app.

transformers' server answers some bad requests with a 500 and a traceback in its log (an empty
message list, max_tokens -1) and takes a prompt longer than the model's context to the model
itself, which on a CPU can run for minutes and take tens of GiB before anything else is
answered. This ASGI middleware reads the body of each generation request first and answers
those with a 4xx and one line, in OpenAI's error shape ({"error": {"message", "type", "param",
"code"}}), which the openai client raises as BadRequestError / NotFoundError. A request that
passes goes on to the engine with the same body, but for thinking's alias and, where it names no
max tokens, the engine's default (1024) cut to what the context leaves.
"""
import json

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# The engine's own management routes: any client could unload the model or load another folder of
# this disk with them. A server pinned to one model does not offer them, nor the engine's routes for
# other kinds of model (typed decisions over images, speech to text), which a text model fails.
CLOSED_PATHS = ("/load_model", "/reset", "/v1/systemone", "/v1/audio/transcriptions")
ENGINE_MAX_NEW_TOKENS = 1024  # what transformers' serve generates where a request names no limit
MAX_BODY_BYTES = 32 << 20  # far above any prompt that fits the context


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def guard(app, model_id, context, tokenizer, template_defaults=None):
    """`app` behind the checks, for a server pinned to `model_id` whose model reads `context` tokens."""
    check = RequestCheck(model_id, context, tokenizer, template_defaults or {})
    return RequestGuard(app, check)


class RequestGuard:
    """Pure ASGI (not Starlette's BaseHTTPMiddleware), so streamed replies and a client's disconnect
    pass through untouched."""

    def __init__(self, app, check):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] in CLOSED_PATHS:
            return await answer(send, BadRequest(f"{scope['path']} is not offered by this server", status=404))
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY_BYTES:
                return await answer(send, BadRequest(f"the request body is over {MAX_BODY_BYTES >> 20} MiB",
                                                     status=413))
        try:
            body = self.check(scope["path"], body)
        except BadRequest as e:
            return await answer(send, e)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # the app's wait for a disconnect goes to the client's socket
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def answer(send, error: BadRequest):
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    payload = json.dumps({"error": {"message": str(error), "type": kind, "param": error.param,
                                    "code": error.code}}).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class RequestCheck:
    """Parses and checks one request body; returns the body to pass on, or raises BadRequest."""

    def __init__(self, model_id, context, tokenizer, template_defaults):
        self.model_id, self.context, self.tokenizer = model_id, context, tokenizer
        self.template_defaults = template_defaults

    def __call__(self, path, raw: bytes) -> bytes:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.model_id!r} "
                             f"(GET /v1/models)", param="model", status=404, code="model_not_found")
        if body.get("generation_config") is not None:  # the engine's json.loads of it would be a 500
            raise BadRequest("generation_config is not taken by this server: pass max_tokens, temperature, top_p, "
                             "seed, stop, frequency_penalty or logit_bias", param="generation_config")
        self._check_sampling(body)
        name, limit = self._max_tokens(body, path)
        if path == "/v1/chat/completions":
            prompt_tokens = self._chat_prompt_tokens(body)
        elif path == "/v1/completions":
            prompt_tokens = self._text_prompt_tokens(body.get("prompt"), "prompt")
        else:  # the Responses API: its instructions go in as a system turn
            prompt_tokens = self._text_prompt_tokens(body.get("input"), "input")
            if body.get("instructions") is not None:
                prompt_tokens += self._text_prompt_tokens(body["instructions"], "instructions")
        if prompt_tokens + (limit or 1) > self.context:
            raise BadRequest(f"the prompt is {prompt_tokens} tokens and asks for {limit or 1} more, over the "
                             f"model's context of {self.context} tokens: shorten the conversation or max_tokens",
                             param="messages", code="context_length_exceeded")
        if limit is None:
            body[name] = min(ENGINE_MAX_NEW_TOKENS, self.context - prompt_tokens)
        return json.dumps(body).encode()

    @staticmethod
    def _max_tokens(body, path) -> tuple[str, int | None]:
        """(the field the engine reads the limit from, the limit or None where the request names none)."""
        names = ("max_output_tokens",) if path == "/v1/responses" else ("max_completion_tokens", "max_tokens")
        for name in names:
            value = body.get(name)
            if value is None:
                continue
            if not is_whole(value) or value < 1:
                raise BadRequest(f"{name} must be a whole number of at least 1, got {value!r}", param=name)
            return name, value
        return names[-1], None

    @staticmethod
    def _check_sampling(body):
        """The sampling fields the engine converts with float(), int() or as a mapping: a wrong type
        would be a 500 there."""
        ranges = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "frequency_penalty": (-2.0, 2.0)}
        for name, (low, high) in ranges.items():
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise BadRequest(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
        if body.get("seed") is not None and not is_whole(body["seed"]):
            raise BadRequest(f"seed must be a whole number, got {body['seed']!r}", param="seed")
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and all(
                isinstance(s, str) for s in stop)):
            raise BadRequest("stop must be a string or a list of strings", param="stop")
        bias = body.get("logit_bias")
        if bias is not None and not (isinstance(bias, dict) and all(
                isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in bias.items())):
            raise BadRequest("logit_bias must map token ids (as strings) to numbers", param="logit_bias")

    def _chat_prompt_tokens(self, body) -> int:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} turns", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", param="messages")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
        kwargs = dict(kwargs or {})
        # Qwen3's name for the switch our template calls open_thinking (model/chat_template.jinja).
        if "enable_thinking" in kwargs:
            kwargs.setdefault("open_thinking", bool(kwargs.pop("enable_thinking")))
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        turns = [{"role": m["role"], "content": text_of(m.get("content"))} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, **{**self.template_defaults, **kwargs})
        except Exception as e:  # a template error is the request's: one line, not a 500
            raise BadRequest(f"the messages do not render with the chat template: {e}", param="messages") from None
        return len(ids["input_ids"])

    def _text_prompt_tokens(self, prompt, name) -> int:
        if isinstance(prompt, list):  # the Responses API's list of items: their text
            prompt = " ".join(text_of(item.get("content"), name) if isinstance(item, dict) else str(item)
                              for item in prompt)
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest(f"{name} must be a non-empty string", param=name)
        return len(self.tokenizer(prompt, add_special_tokens=False).input_ids)


def is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text_of(content, param="messages") -> str:
    """A message's text: a string, or the text parts of a list of content parts (each an object
    with a type), which is what the engine reads; anything else is the request's error."""
    if isinstance(content, list):
        if not all(isinstance(part, dict) and isinstance(part.get("type"), str) for part in content):
            raise BadRequest("each content part must be an object with a type", param=param)
        texts = [part.get("text", "") for part in content]
        if not all(isinstance(text, str) for text in texts):
            raise BadRequest("a content part's text must be a string", param=param)
        return " ".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise BadRequest(f"a message's content must be a string or a list of content parts, got "
                         f"{type(content).__name__}", param=param)
    return content
