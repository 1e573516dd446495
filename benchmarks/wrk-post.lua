-- POST a small completion request (max_tokens from WRK_MAX_TOKENS, default 2: 1 for a real vLLM, whose served
-- model is also "tiny"), naming the models of WRK_MODELS in turn (default "tiny"); at the end print one
-- machine-readable line for fixed.py and realvllm.py.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {}
for model in string.gmatch(os.getenv("WRK_MODELS") or "tiny", "[^,]+") do
   bodies[#bodies + 1] = '{"model":"' .. model .. '","prompt":"The capital of France is","max_tokens":'
      .. (os.getenv("WRK_MAX_TOKENS") or "2") .. '}'
end
wrk.body = bodies[1]
local n = 0

if #bodies > 1 then
   request = function()
      n = n % #bodies + 1
      return wrk.format(nil, nil, nil, bodies[n])
   end
end

done = function(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRKJSON {"requests":%d,"duration_us":%d,"errors":%d,"non2xx":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f}\n',
      summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
