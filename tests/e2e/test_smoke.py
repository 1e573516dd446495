async def test_a_completion_passes_through_and_the_engine_sees_no_violation(make_stack):
    stack = await make_stack()
    resp = await stack.completion()
    assert resp.status == 200
    body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert stack.sim.violations == []
