"""The pure stream protocol: no Redis, Litestar, SQLAlchemy or vLLM imports here, and
nothing else of the project (``tests/unit/test_layout.py``).

lifecycle  -- request states, finish reasons, verdicts, meta-hash fields (and the Lua prelude)
params     -- the sampling parameters, from the request schema to the engine
events     -- the log's event types and the outbox summary
ids        -- event ids and SSE cursors (parse, format, compare)
detokenize -- incremental detokenizer over the tokenizer's streaming decoder
holdback   -- multi-stop-string holdback
assemble   -- detokenizer + holdback + counters for one request (what a worker runs per step)
sse        -- SSE framing
render     -- log events -> OpenAI chunk / response objects
replay     -- a log re-rendered for audit, at its original pace or faster
archive    -- the archive format of a finished log
"""
