"""Several engines behind one port: the top level routes by model and refuses what names no engine; each
engine's own base URL, /engines/<name>/, behaves as the single-engine proxy does."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from openai import AsyncOpenAI

from tests.e2e.conftest import EnginesStack, raw_exchange, status_of

MakeEngines = Callable[..., Awaitable[EnginesStack]]


async def test_an_unknown_model_gets_vllms_own_404(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    resp = await stack.completion("no-such-model")
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert {k: error[k] for k in ("message", "type", "param", "code")} == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert resp.headers["X-Lifeguard-Reason"] == "model_not_found"
    # The same four fields as the engine's own answer (the simulator follows vLLM 0.32 as measured).
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 1}
    own = await stack.client.post("/engines/a/v1/completions", json=body)
    assert own.status == 404
    assert {k: error[k] for k in ("message", "type", "param", "code")} == (await own.json())["error"]


async def test_models_lists_every_engines_models(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    resp = await stack.client.get("/v1/models")
    assert resp.status == 200
    assert sorted(card["id"] for card in (await resp.json())["data"]) == ["model-a", "model-b"]
    state = await stack.state()
    assert state["engines"]["a"]["models"] == ["model-a"] and state["engines"]["b"]["models"] == ["model-b"]


async def test_an_unprefixed_lifecycle_call_is_400_naming_the_choice(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    resp = await stack.client.post("/sleep?level=1")
    assert resp.status == 400
    assert resp.headers["X-Lifeguard-Reason"] == "engine_not_chosen"
    message = (await resp.json())["error"]["message"]
    assert "/engines/a/sleep" in message and "/engines/b/sleep" in message
    assert stack.sim_count("a", "sleep") == 0
    # A request naming no model, and a route that is not inference, must choose too.
    assert (await stack.client.get("/health")).status == 400
    assert (await stack.client.post("/v1/completions", json={"prompt": "x"})).status == 400


async def test_the_top_level_is_ready_while_any_engine_is(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    resp = await stack.client.get("/lifeguard/readyz")
    assert resp.status == 200 and await resp.json() == {"ready": True, "engines": {"a": "RUNNING", "b": "SLEEPING"}}
    stack.sim("a").die("test")
    await stack.wait_for(lambda s: s["engines"]["a"]["state"] == "FAILED")
    assert (await stack.client.get("/lifeguard/readyz")).status == 200  # b is asleep: it can be swapped in
    assert (await stack.client.get("/engines/a/lifeguard/readyz")).status == 503
    assert (await stack.client.get("/lifeguard/healthz")).status == 200


async def test_an_unknown_engine_is_404(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    for path in ("/engines/zzz/health", "/engines/zzz", "/engines/", "/engines"):
        resp = await stack.client.get(path)
        assert resp.status == 404, path
        assert resp.headers["X-Lifeguard-Reason"] == "unknown_engine"
        assert "a, b" in (await resp.json())["error"]["message"]


async def test_an_engines_bare_base_url_is_its_root(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    for path in ("/engines/a", "/engines/a/"):
        resp = await stack.client.get(path)
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}, path  # vLLM's own answer for /


async def test_each_engines_base_url_is_the_single_engine_proxy(make_engines: MakeEngines) -> None:
    stack = await make_engines(asleep=())  # BIG engines do not both fit, but the simulator lets them start so
    state = await (await stack.client.get("/engines/a/lifeguard/state")).json()
    assert state["state"] == "RUNNING" and state["upstream"] == str(stack.sims["a"].make_url("")).rstrip("/")
    resp = await stack.client.post("/engines/a/sleep?level=1")
    assert resp.status == 200 and resp.headers["X-Lifeguard-Verified"].startswith("health=pass,flags=pass")
    assert stack.sim("a").is_sleeping and not stack.sim("b").is_sleeping
    noop = await stack.client.post("/engines/a/sleep?level=1")
    assert noop.status == 200 and noop.headers["X-Lifeguard-Noop"] == "true"
    assert (await (await stack.client.get("/engines/a/is_sleeping")).json()) == {"is_sleeping": True}
    bad = await stack.client.post("/engines/a/sleep?mode=never")
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "query.mode"
    resp = await stack.client.post(
        "/engines/b/v1/completions", json={"model": "model-b", "prompt": "x", "max_tokens": 2}
    )
    assert resp.status == 200
    assert (await stack.client.get("/engines/b/v1/models")).status == 200
    assert (await stack.client.get("/engines/b/lifeguard/readyz")).status == 200
    assert (await stack.client.get("/engines/b/lifeguard/metrics")).status == 200
    assert stack.violations() == {}


async def test_dot_segments_are_refused_on_the_whole_target(make_engines: MakeEngines) -> None:
    stack = await make_engines()
    for target in ("/engines/a/../b/sleep", "/engines/a/./sleep", "/engines/a//sleep", "/engines/%2e%2e/b/sleep"):
        raw = await raw_exchange(
            stack_like(stack),
            f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode(),
        )
        assert status_of(raw) == 400, (target, raw[:300])
        assert b"bad_request_target" in raw, target
    assert (stack.sim_count("a", "sleep"), stack.sim_count("b", "sleep")) == (0, 1)  # b's: before the proxy


def stack_like(stack: EnginesStack) -> object:
    """`raw_exchange` only needs `.client.server`."""

    class _Like:
        client = stack.client

    return _Like()


async def test_a_percent_encoded_mount_is_read_as_its_engine(make_engines: MakeEngines) -> None:
    stack = await make_engines(asleep=())
    resp = await stack.client.get("/engines/%61/is_sleeping")  # %61 is "a"
    assert resp.status == 200


async def test_the_openai_sdk_talks_to_two_models_through_one_base_url(make_engines: MakeEngines) -> None:
    """Code nobody here wrote: the openai client, one base URL, two models; the swap is invisible to it."""
    stack = await make_engines()
    client = AsyncOpenAI(base_url=str(stack.client.make_url("/v1")), api_key="unused", max_retries=0, timeout=30)
    try:
        models = sorted(model.id for model in (await client.models.list()).data)
        assert models == ["model-a", "model-b"]
        for model in ("model-b", "model-a", "model-b"):
            completion = await client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
            assert completion.model == model and completion.choices[0].text
        chat = await client.chat.completions.create(
            model="model-a", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.model == "model-a"
    finally:
        await client.close()
    assert stack.sim_count("b", "wake_up") == 2 and stack.sim_count("a", "wake_up") == 2
    assert stack.violations() == {}
