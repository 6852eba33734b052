"""The pure stream protocol: no Redis, Litestar, SQLAlchemy or vLLM imports here.

events     -- the log's event types and the terminal-state enum
ids        -- event ids and SSE cursors (parse, format, compare)
detokenize -- incremental detokenizer over the tokenizer's streaming decoder
holdback   -- multi-stop-string holdback
assemble   -- detokenizer + holdback + counters for one request (what a worker runs per step)
sse        -- SSE framing
render     -- log events -> OpenAI chunk / response objects
"""
