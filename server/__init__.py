"""ds4-server: OpenAI Chat/Completions, Anthropic Messages and OpenAI Responses over the engine.

Modules, in the order a request meets them:

- `cli`        flags -> `config.ServerConfig`, model loading, startup banner, uvicorn.
- `app`        FastAPI app factory: routes, body limit, error rendering, job submission.
- `jsonparse`  hardened JSON body parsing (depth, NaN, duplicate keys, surrogates, UTF-8).
- `api_openai`, `api_anthropic`, `api_responses`
               per-API schema, validation, translation to a `GenerationRequest`, and the
               JSON / SSE answers in that API's field names and error shape.
- `apibase`    what the three share: strict schema base, limits, ignore_eos rules, ids.
- `prompting`  the text seams: chat -> prompt text, generated text -> content/reasoning/tool calls.
- `worker`     job queue and the single inference thread that owns the engine session(s).
- `batching`   `--batched-session N`: slot routing and the batched loop over the engine's scheduler.
- `kvstore`, `kvstore_policy`
               the disk KV cache (`--kv-disk-dir`): checkpoint files, lookup, save policy, eviction.
- `stops`      stop-sequence matching over streamed text.
- `sse`        SSE framing, keepalives, disconnect watching.
- `errors`     client-facing errors in each API's shape.
- `tools/`     tool-call and thinking syntaxes (pure text; no engine import).

The server imports `engine` only through the model object handed to `app.create_app` and
the two engine classes the worker needs (`SamplingParams`, `Cancelled`), so tests run it
over a fake engine; batched sessions (`batching`) need the real engine's scheduler and are
tested on tiny random GGUF models.
"""
