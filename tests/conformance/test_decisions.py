"""vLLM 0.33's `POST /v1/decisions` (openai/decisions/): answers shaped like `make_answer`'s; absent on 0.32."""

from __future__ import annotations

import math

from tests.conformance.api import VllmApi

QUESTIONS = [
    {"type": "predicate", "name": "is_question", "instructions": "Is the input a question?"},
    {
        "type": "choice",
        "instructions": "Which colour?",
        "choices": [{"value": "red"}, {"value": "blue"}, {"value": True}],
    },
    {"type": "score", "instructions": "How polite?", "levels": [{"label": "rude"}, {"label": "ok"}, {"label": "kind"}]},
]


async def test_decisions_answer_every_question_on_033_and_is_not_found_on_032(vllm: VllmApi, vllm_version: str) -> None:
    body = {"model": vllm.model, "input": "Could you pass the salt?", "questions": QUESTIONS}
    answer = await vllm.call("POST", "/v1/decisions", json_body=body)
    if vllm_version == "0.32":
        assert (answer.status, answer.body) == (404, {"detail": "Not Found"})
        return
    assert answer.status == 200, answer.text
    assert answer.body["model"] == vllm.model
    predicate, choice, score = answer.body["answers"]
    assert predicate["type"] == "predicate" and predicate["name"] == "is_question"
    assert 0.0 <= predicate["probability"] <= 1.0
    assert choice["type"] == "choice" and choice["name"] is None
    assert [p["value"] for p in choice["probabilities"]] == ["red", "blue", True]
    assert math.isclose(sum(p["probability"] for p in choice["probabilities"]), 1.0, abs_tol=1e-4)
    assert choice["choice"] in ("red", "blue", True)
    assert [(p["value"], p["label"]) for p in score["probabilities"]] == [(0, "rude"), (1, "ok"), (2, "kind")]
    assert 0.0 <= score["score"] <= 2.0
    assert set(answer.body["usage"]) >= {"input_tokens", "output_tokens", "total_tokens"}
    again = await vllm.call("POST", "/v1/decisions", json_body=body)
    assert again.body["answers"] == answer.body["answers"]  # greedy label reads: the same weights answer the same


async def test_a_decision_sent_during_a_pause_is_refused_like_a_completion(vllm: VllmApi, vllm_version: str) -> None:
    await vllm.post("/pause", mode="abort")
    body = {"model": vllm.model, "input": "hi", "questions": QUESTIONS[:1]}
    answer = await vllm.call("POST", "/v1/decisions", json_body=body)
    expected = 404 if vllm_version == "0.32" else 503
    assert answer.status == expected
    if expected == 503:
        assert answer.body["error"]["type"] == "ServiceUnavailableError"


async def test_a_decision_without_questions_is_400(vllm: VllmApi, vllm_version: str) -> None:
    answer = await vllm.call("POST", "/v1/decisions", json_body={"model": vllm.model, "input": "hi", "questions": []})
    assert answer.status == (404 if vllm_version == "0.32" else 400)
