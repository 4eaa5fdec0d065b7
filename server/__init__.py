"""ds4-server: OpenAI Chat/Completions, Anthropic Messages and OpenAI Responses over the engine.

Modules, in the order a request meets them:

- `cli`        flags -> `config.ServerConfig`, model loading, startup banner, uvicorn.
- `edge`       the listening socket and the HTTP protocol: header deadline and size, connection limit.
- `framing`    which request heads frame their body ambiguously (Content-Length and Transfer-Encoding).
- `app`        FastAPI app factory: middleware (metrics, API key, Host allow-list, CORS), error rendering.
- `guard`      API key and Host checks (pure) and their middleware.
- `endpoints`  the endpoint table and the one request path of the inference endpoints.
- `httpbody`   Content-Type / Content-Encoding rules and the body read with its size and time limits.
- `prepare`    the bounded pool where bodies are parsed, prompts rendered and tokenized.
- `jsonparse`  hardened JSON body parsing (depth, NaN, duplicate keys, surrogates, UTF-8).
- `api_openai`, `api_anthropic`, `api_responses`, `api_tokenize`
               per-API schema, validation, translation to a `GenerationRequest`, and the
               JSON / SSE answers in that API's field names and error shape.
- `apibase`    what they share: strict schema base, field bounds, limits, defaults, ids.
- `genrequest` the one preparation path they call: render, tokenize, context and token-limit
               checks, sampling and stops -> `GenerationRequest`, the same errors for every API.
- `choices`    `n` and several prompts: one job per choice, events merged by choice index.
- `scoring`    prompt log-probs (`echo` with `logprobs`) in the legacy completions form.
- `prompting`  the text seams: chat -> prompt text, generated text -> content/reasoning/tool calls.
- `jobs`       requests, events, the per-token decoder and the ledger both loops share.
- `worker`, `serial`
               the inference thread that owns the engine, and its one-session FIFO loop.
- `batching`   `--batched-session N`: slot routing and the batched loop over the engine's scheduler.
- `kvplan`, `kvstore`, `kvstore_policy`
               the disk KV cache (`--kv-disk-dir`): what the loops do, the files, the pure policy.
- `metrics`    `GET /metrics` (Prometheus), fed through the ledger's observer seam.
- `stops`      stop-sequence matching over streamed text.
- `sse`        SSE framing, keepalives, disconnect watching.
- `errors`     client-facing errors in each API's shape.
- `tools/`     tool-call and thinking syntaxes (pure text; no engine import).

The server imports `engine` only through the model object handed to `app.create_app` and
the two engine classes the worker needs (`SamplingParams`, `Cancelled`), so tests run it
over a fake engine; batched sessions (`batching`) need the real engine's scheduler and are
tested on tiny random GGUF models.
"""
