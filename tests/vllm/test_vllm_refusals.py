"""proxy/upstream/refusals.py against the bytes vLLM's own serializers make (the installed vLLM 0.32's code, which
0.33's
paused refusal goes through unchanged: RetryableRequestError, create_error_response, starlette's JSONResponse,
the stream generators' json.dumps and pydantic dumps), and the simulator's 0.33 profile against the same bytes.

vLLM 0.33 is a GPU-only wheel; 0.32 already has every piece its `engine_paused` answer is made of
(vllm/exceptions.py RetryableRequestError, serve/exception_handling/error_response.py), so nothing here is
retyped from a reading of the source: it is vLLM's code writing its answer.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lifeguard_sim import errors
from lifeguard_sim.responses import dumps
from proxy.upstream.refusals import Refusal, RefusalKind, response_refusal, stream_refusal

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]

VLLM_WRITES = r"""
import json
from starlette.responses import JSONResponse
from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, RetryableRequestError
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.v1.engine.exceptions import EngineDeadError

paused = RetryableRequestError("Generation is paused. Please retry after it resumes.")

def answer(exc):
    err = create_error_response(exc)
    return err.error.code, JSONResponse(err.model_dump(), status_code=err.error.code).body.decode()

out = {
    # a non-streaming request: the handler's JSONResponse
    "paused": answer(paused),
    # completions stream: create_streaming_error_response = json.dumps(create_error_response(e).model_dump())
    "paused_completion_event": "data: " + json.dumps(create_error_response(paused).model_dump()) + "\n\n",
    # 0.33's chat stream: create_error_response(str(e), "InternalServerError", e.status_code).model_dump_json()
    "paused_chat_event": "data: " + create_error_response(
        str(paused), err_type="InternalServerError", status_code=paused.status_code).model_dump_json() + "\n\n",
    "queue_overflow": answer(QueueOverflowError()),
    "queued_tokens": answer(MaxQueuedTokensError()),
    "engine_dead": answer(EngineDeadError()),
    "queue_overflow_event": "data: " + json.dumps(create_error_response(QueueOverflowError()).model_dump()) + "\n\n",
    # serve/elastic_ep/middleware.py
    "scaling": (503, JSONResponse({"error": "The model is currently scaling. Please try again later."},
                                  status_code=503).body.decode()),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def written() -> dict[str, object]:
    done = subprocess.run(
        [os.environ["LIFEGUARD_VLLM_PYTHON"], "-c", VLLM_WRITES], capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _answer(written: dict[str, object], name: str) -> tuple[int, bytes]:
    status, body = written[name]  # type: ignore[misc]
    return int(status), str(body).encode()


def test_vllms_paused_answer_is_recognised_and_the_simulator_writes_the_same_bytes(written: dict[str, object]) -> None:
    status, body = _answer(written, "paused")
    assert status == 503
    refusal = response_refusal(status, JSON, body)
    assert refusal is not None and refusal.kind is RefusalKind.ENGINE_PAUSED
    assert dumps(errors.engine_paused_body()).encode() == body


@pytest.mark.parametrize(("name", "chat"), [("paused_completion_event", False), ("paused_chat_event", True)])
def test_vllms_paused_stream_events_are_recognised_and_the_simulator_writes_the_same_bytes(
    written: dict[str, object], name: str, chat: bool
) -> None:
    event = str(written[name]).encode()
    refusal = stream_refusal(200, SSE, event + b"data: [DONE]\n\n")
    assert isinstance(refusal, Refusal) and refusal.kind is RefusalKind.ENGINE_PAUSED
    assert errors.engine_paused_event(chat=chat) == event


@pytest.mark.parametrize("name", ["queue_overflow", "queued_tokens", "engine_dead"])
def test_vllms_other_refusals_are_not_taken_for_a_pause(written: dict[str, object], name: str) -> None:
    status, body = _answer(written, name)
    assert response_refusal(status, JSON, body) is None


def test_the_queue_limits_refusal_inside_a_stream_is_not_taken_for_a_pause(written: dict[str, object]) -> None:
    event = str(written["queue_overflow_event"]).encode()
    assert stream_refusal(200, SSE, event + b"data: [DONE]\n\n") is None


def test_the_elastic_ep_middlewares_answer_is_the_elastic_refusal(written: dict[str, object]) -> None:
    status, body = _answer(written, "scaling")
    refusal = response_refusal(status, JSON, body)
    assert refusal is not None and refusal.kind is RefusalKind.ELASTIC_EP
