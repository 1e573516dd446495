"""``/v1/completions`` and ``/v1/chat/completions``, streaming (SSE) and not.

A request is handed to the engine as soon as its body parses; from then on the engine decides whether
it is held, runs, freezes, or ends with ``finish_reason: "abort"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from lifeguard_sim import errors, generation
from lifeguard_sim.engine import Engine
from lifeguard_sim.errors import EngineHTTPError, EnginePaused
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.prefix_cache import salt_problem
from lifeguard_sim.responses import dumps, json_response
from lifeguard_sim.scheduler import SimRequest, spans
from lifeguard_sim.textgen import Token, piece_id, tokenize


@dataclass(frozen=True)
class GenSpec:
    chat: bool
    prompt: str
    prompt_tokens: int
    max_tokens: int
    natural_stop: bool
    stream: bool
    include_usage: bool
    logprobs: int | None
    stop: tuple[str, ...]
    model: str
    prompt_ids: tuple[int, ...] = ()
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    cache_salt: str | None = None
    # The release has `weight_versions` on its choices (0.33+), and whether the request asked for the spans.
    spans_field: bool = False
    return_weight_versions: bool = False


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise errors.bad_request("'messages' must be a non-empty list", "messages")
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise errors.bad_request("each message must be an object", "messages")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<s>{message.get('role', 'user')}: {content or ''}</s>\n")
    return "".join(parts) + "<s>assistant: "


def json_body(raw: bytes) -> dict[str, Any]:
    return errors.json_object(raw, decode_message="Invalid JSON in request body")


def check_model(engine: Engine, model: Any) -> str:
    """The served name a request asked for: the base model or a loaded LoRA adapter; 404 otherwise."""
    if model is None:
        return engine.settings.model
    if model != engine.settings.model and model not in engine.lora_adapters:
        raise EngineHTTPError(
            404, errors.openai_error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
        )
    return str(model)


def _spec(engine: Engine, body: dict[str, Any], *, chat: bool, prompt_in: Any = None) -> GenSpec:
    model = check_model(engine, body.get("model"))
    if (problem := salt_problem(body.get("cache_salt"))) is not None:
        raise errors.bad_request(problem, "cache_salt")
    prompt_ids: tuple[int, ...] = ()
    if chat:
        prompt = chat_prompt(body.get("messages"))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        want_logprobs = bool(body.get("logprobs"))
        top = int(body.get("top_logprobs") or 0)
        logprobs = max(top, 1) if want_logprobs else None
    else:
        prompt = _completion_prompt(prompt_in)
        if isinstance(prompt_in, list):
            prompt_ids = tuple(prompt_in)
        limit = body.get("max_tokens", 16)
        raw_logprobs = body.get("logprobs")
        logprobs = None if raw_logprobs is None else int(raw_logprobs)
    prompt_tokens = max(1, len(tokenize(prompt)))
    room = engine.settings.max_model_len - prompt_tokens
    if limit is not None and (not isinstance(limit, int) or limit < 1 or limit > room):
        raise errors.bad_request(
            f"This model's maximum context length is {engine.settings.max_model_len} tokens. However, you "
            f"requested {prompt_tokens} input tokens and {limit} output tokens; max_tokens must be 1..{room}.",
            "max_tokens",
        )
    stop = body.get("stop") or ()
    stream_options = body.get("stream_options") or {}
    return GenSpec(
        chat=chat,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=room if limit is None else limit,
        natural_stop=limit is None or (chat and not body.get("ignore_eos")),
        stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        logprobs=logprobs,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        model=model,
        prompt_ids=prompt_ids or tuple(tokenize(prompt)),
        return_token_ids=bool(body.get("return_token_ids")),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        cache_salt=body.get("cache_salt"),
        spans_field=engine.profile.completion_spans,
        return_weight_versions=bool(body.get("return_weight_versions")),
    )


def _completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
        return " ".join(str(t) for t in prompt)
    if not isinstance(prompt, str):
        raise errors.bad_request("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    return prompt


def _completion_prompts(prompt: Any) -> list[Any]:
    """A batch: a list of strings or of token-id lists is several prompts (vLLM answers prompt-major)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt]


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[SIM_ENGINE]
    body = json_body(await request.read())
    prompts = [None] if chat else _completion_prompts(body.get("prompt"))
    n = body.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise errors.bad_request("n must be at least 1.", "n")
    specs = [_spec(engine, body, chat=chat, prompt_in=p) for p in prompts for _ in range(n)]
    await engine.trainer_gate.wait()  # a trainer's server wrapper may hold requests before the engine
    if len(specs) > 1:
        if specs[0].stream:
            raise errors.bad_request("the simulator streams one choice per request (n=1, one prompt)", "stream")
        shapers = await asyncio.gather(*(_run_whole(request, spec) for spec in specs))
        return json_response(_merge(shapers))
    spec = specs[0]
    try:
        req, writer, tokens = await _begin(request, spec, "chatcmpl" if chat else "cmpl")
    except EnginePaused:
        if not spec.stream:
            raise
        # vLLM 0.33 streams: the 200 and its headers go out first, the refusal arrives inside the generator.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        await response.write(errors.engine_paused_event(chat=chat))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    async with contextlib.aclosing(tokens):
        if not spec.stream:
            await _collect(engine, req, writer, tokens)
            return json_response(writer.whole())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        try:
            async for token in tokens:
                stopped = writer.add(token)
                if stopped:
                    engine.scheduler.finish(req, "stop")
                if not response.prepared:
                    await response.prepare(request)
                    if chat:
                        await _send(response, writer.chunk("", None, role=True))
                last = req.produced >= req.max_tokens and not stopped
                await _send(response, writer.chunk(writer.pending(), "length" if last else None, token))
                if stopped:
                    break
            if not response.prepared:
                await response.prepare(request)
                if chat:
                    await _send(response, writer.chunk("", None, role=True))
            if not (req.finish_reason == "length" and req.produced == req.max_tokens):
                await _send(response, writer.chunk("", req.finish_reason))
        except EngineHTTPError as exc:
            if not response.prepared:
                raise
            await _send(response, exc.body)
        except ConnectionError:
            return response
        if spec.include_usage:
            await _send(response, writer.usage_chunk())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _collect(engine: Engine, req: SimRequest, writer: _Shaper, tokens: AsyncIterator[Token]) -> None:
    async for token in tokens:
        if writer.add(token):
            engine.scheduler.finish(req, "stop")
            break


async def _begin(
    request: web.Request, spec: GenSpec, kind: str
) -> tuple[SimRequest, _Shaper, AsyncGenerator[Token, None]]:
    """One engine request for `spec`, admitted: the request, the shaper of its answer, and its tokens."""
    engine = request.app[SIM_ENGINE]
    req = generation.new_request(
        kind,
        prompt_tokens=spec.prompt_tokens,
        max_tokens=spec.max_tokens,
        external_id=request.headers.get("X-Request-Id"),
        client_gone=lambda: request.transport is None or request.transport.is_closing(),
    )
    fired = await generation.admit(engine, req)
    prompt = generation.Prompt(spec.prompt, spec.prompt_ids, spec.model, spec.cache_salt, spec.logprobs or 0)
    writer = _Shaper(spec.model, req, spec)
    return req, writer, generation.generate(engine, req, prompt, fired, natural_stop=spec.natural_stop)


async def _run_whole(request: web.Request, spec: GenSpec) -> _Shaper:
    """One choice of a batched request: its own engine request, generated to the end."""
    req, writer, tokens = await _begin(request, spec, "cmpl")
    async with contextlib.aclosing(tokens):
        await _collect(request.app[SIM_ENGINE], req, writer, tokens)
    return writer


def _merge(shapers: list[_Shaper]) -> dict[str, Any]:
    bodies = [shaper.whole() for shaper in shapers]
    merged = bodies[0]
    merged["choices"] = [dict(body["choices"][0], index=i) for i, body in enumerate(bodies)]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for body in bodies:
        for key in usage:
            usage[key] += body["usage"][key]
    merged["usage"] = usage
    return merged


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(f"data: {dumps(payload)}\n\n".encode())


class _Shaper:
    """Builds OpenAI-shaped chunks and the final body from the tokens seen so far."""

    def __init__(self, model: str, req: SimRequest, spec: GenSpec) -> None:
        self._model = model
        self._req = req
        self._spec = spec
        self._created = int(time.time())
        self.text = ""
        self._sent = 0
        self._tokens: list[Token] = []

    def add(self, token: Token) -> bool:
        """Append a token; True when a stop string completed (the text is cut before it)."""
        self._tokens.append(token)
        self.text += token.text
        for stop in self._spec.stop:
            at = self.text.find(stop)
            if stop and at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def pending(self) -> str:
        delta = self.text[self._sent :]
        self._sent = len(self.text)
        return delta

    def _usage(self) -> dict[str, Any]:
        done = len(self._tokens)
        prompt = self._spec.prompt_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}

    def _logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        if self._spec.logprobs is None:
            return None
        as_ids = self._spec.tokens_as_ids
        if self._spec.chat:
            return {"content": [_chat_logprob(t, as_ids) for t in tokens]}
        return {
            "tokens": [_token_str(t.text, as_ids) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{_token_str(text, as_ids): lp for text, lp in t.top} for t in tokens],
            "text_offset": list(range(len(tokens))),
        }

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self._spec.chat else "text_completion") + (
            ".chunk" if chunk and self._spec.chat else ""
        )
        return {
            "id": self._req.request_id,
            "object": kind,
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }

    def _spans(self) -> list[dict[str, object]] | None:
        """A choice's `weight_versions`: the spans when the request asked for them, else null."""
        if not self._spec.return_weight_versions:
            return None
        return spans(self._req.version_starts, self._req.produced)

    def chunk(self, text: str, finish: str | None, token: Token | None = None, *, role: bool = False) -> dict[str, Any]:
        logprobs = self._logprobs([token]) if token is not None else None
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
        if self._spec.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            choice["text"] = text
        if self._spec.spans_field and (finish is not None or not self._spec.chat):
            # vLLM 0.33 (openai/completion/serving.py) sets weight_versions on every completion chunk, null until the
            # finishing one; the chat generator (openai/chat_completion/serving.py) sets it on the finishing chunk
            # only. Each is dumped with exclude_unset, so a field it set to None is still written.
            choice["weight_versions"] = self._spans() if finish is not None else None
        return self._envelope([choice], chunk=True)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope([], chunk=True)
        body["usage"] = self._usage()
        return body

    def whole(self) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": self._logprobs(self._tokens),
            "finish_reason": self._req.finish_reason,
            "stop_reason": None,
        }
        if self._spec.chat:
            choice["message"] = {"role": "assistant", "content": self.text, "tool_calls": []}
        else:
            choice["text"] = self.text
        if self._spec.return_token_ids:
            # vLLM: OpenAI-extension fields, present only when asked for.
            choice["prompt_token_ids"] = list(self._spec.prompt_ids)
            choice["token_ids"] = [t.id for t in self._tokens]
        if self._spec.spans_field:
            choice["weight_versions"] = self._spans()  # model_dump(): null when not asked for
        body = self._envelope([choice], chunk=False)
        body["usage"] = self._usage()
        return body


def _token_str(text: str, as_ids: bool) -> str:
    # vLLM's return_tokens_as_token_ids: every token is "token_id:<id>" instead of its text.
    return f"token_id:{piece_id(text)}" if as_ids else text


def _chat_logprob(token: Token, as_ids: bool) -> dict[str, Any]:
    return {
        "token": _token_str(token.text, as_ids),
        "logprob": token.logprob,
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": _token_str(t, as_ids), "logprob": lp, "bytes": list(t.encode())} for t, lp in token.top
        ],
    }


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
