"""``POST /v1/decisions``: vLLM 0.33's Decisions API (``vllm/entrypoints/openai/decisions/``), on the 0.33 profile only.

A request asks questions about an input; vLLM answers each from label reads on the engine, so the request goes
through the engine like a completion: held while the scheduler is paused or asleep, refused with ``engine_paused``
while a 0.33 user pause rejects new requests. The probabilities are a deterministic function of the weights (and the
adapter), the input and the question, shaped as vLLM's ``make_answer`` shapes them (openai/decisions/adapters.py).
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any

from aiohttp import web

from lifeguard_sim import errors, generation
from lifeguard_sim.keys import SIM_ENGINE
from lifeguard_sim.responses import json_response
from lifeguard_sim.routes_openai import check_model, json_body
from lifeguard_sim.textgen import tokenize

_TYPES = ("predicate", "choice", "score")


def _invalid(loc: str, msg: str, value: object) -> errors.EngineHTTPError:
    return errors.validation_error(loc, "value_error", msg, repr(value))


def _input_text(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(isinstance(m, dict) and m.get("role") == "user" for m in raw):
        parts = []
        for message in raw:
            content = message.get("content")
            if isinstance(content, list):
                content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise _invalid("body.input", "content must be a string or a list of input_text parts", content)
            parts.append(content)
        return "\n\n".join(parts)
    raise _invalid("body.input", "input must be a string or a list of user messages", raw)


def _options(index: int, question: Any) -> tuple[str, int]:
    """The question's type and how many answers it has; 400 naming the field otherwise."""
    loc = f"body.questions.{index}"
    if not isinstance(question, dict) or question.get("type") not in _TYPES:
        raise _invalid(f"{loc}.type", "type must be one of predicate, choice, score", question)
    if not isinstance(question.get("instructions"), str):
        raise _invalid(f"{loc}.instructions", "instructions must be a string", question.get("instructions"))
    kind = str(question["type"])
    if kind == "predicate":
        return kind, 2
    key, low, high = ("choices", 2, 255) if kind == "choice" else ("levels", 2, 10)
    items = question.get(key)
    if not isinstance(items, list) or not low <= len(items) <= high:
        raise _invalid(f"{loc}.{key}", f"{key} must be a list of {low} to {high} items", items)
    return kind, len(items)


def _answer(question: dict[str, Any], kind: str, probs: list[float], label_mass: float) -> dict[str, Any]:
    name = question.get("name")
    if kind == "predicate":
        return {"type": "predicate", "name": name, "probability": probs[1]}
    top = max(range(len(probs)), key=probs.__getitem__)
    confidence = probs[top] * label_mass
    if kind == "choice":
        choices = question["choices"]
        return {
            "type": "choice",
            "name": name,
            "choice": choices[top].get("value"),
            "probabilities": [{"value": c.get("value"), "probability": p} for c, p in zip(choices, probs, strict=True)],
            "confidence": confidence,
        }
    levels = question["levels"]
    return {
        "type": "score",
        "name": name,
        "score": sum(i * p for i, p in enumerate(probs)),
        "probabilities": [
            {"value": i, "label": level.get("label"), "probability": p}
            for i, (level, p) in enumerate(zip(levels, probs, strict=True))
        ],
        "confidence": confidence,
    }


def _read(seed: str, text: str, question: dict[str, Any], count: int, garbage: bool) -> tuple[list[float], float]:
    if garbage:
        return [math.nan] * count, math.nan
    rng = random.Random(f"{seed}\x00{text}\x00{question.get('instructions')}")
    weights = [rng.uniform(0.05, 1.0) ** 3 for _ in range(count)]
    total = sum(weights)
    return [round(w / total, 6) for w in weights], round(rng.uniform(0.6, 0.99), 6)


async def decisions(request: web.Request) -> web.Response:
    engine = request.app[SIM_ENGINE]
    body = json_body(await request.read())
    model = check_model(engine, body.get("model"))
    text = _input_text(body.get("input"))
    questions = body.get("questions")
    if not isinstance(questions, list) or not 1 <= len(questions) <= 200:
        raise _invalid("body.questions", "questions must be a list of 1 to 200 questions", questions)
    shapes = [_options(i, q) for i, q in enumerate(questions)]
    prompt_tokens = max(1, len(tokenize(text)))
    await engine.trainer_gate.wait()
    req = generation.new_request(
        "decision",
        prompt_tokens=prompt_tokens,
        max_tokens=len(questions),  # one label read per question
        external_id=request.headers.get("X-Request-Id"),
        client_gone=lambda: request.transport is None or request.transport.is_closing(),
    )
    fired = await generation.admit(engine, req)
    prompt = generation.Prompt(text, tuple(tokenize(text)), model, body.get("cache_salt"))
    tokens = generation.generate(engine, req, prompt, fired, natural_stop=False)
    async with contextlib.aclosing(tokens):
        async for _token in tokens:
            pass
    seed = engine.model_seed(model) if engine.weights_valid else f"{engine.text_seed}\x00garbled"
    answers = []
    for question, (kind, count) in zip(questions, shapes, strict=True):
        probs, mass = _read(seed, text, question, count, engine.garbage)
        answers.append(_answer(question, kind, probs, mass))
    usage = {
        "input_tokens": prompt_tokens * len(questions),
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens * len(questions),
    }
    return json_response({"model": model, "answers": answers, "usage": usage})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/decisions", decisions)
