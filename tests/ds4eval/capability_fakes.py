"""An OpenAI-compatible fake server whose every request feature can be made to work, be ignored
or be refused, for the capability-probe tests (http.server on 127.0.0.1, no model).

`FakeCapabilities(modes={"seed": "ignore", ...}, delay_s=0)`: each feature of
`ds4eval.run.capabilities.FEATURES` is "support" (the default), "ignore" (accepted without effect)
or "reject" (HTTP 400); "token counts" also takes "broken" (usage whose total does not add up)
and "seed" "constant" (the same text whatever the seed). Chat requests are answered as JSON or
as a stream, completions as JSON. Request bodies are kept in `bodies`.
"""

from __future__ import annotations

import json
import time
import uuid

from openai_fakes import JsonHandler, serve, stop


class FakeCapabilities:
    def __init__(self, modes=None, delay_s=0.0, reply="yes"):
        self.modes, self.delay_s, self.reply = dict(modes or {}), delay_s, reply
        self.bodies: list[dict] = []

    def mode(self, feature: str) -> str:
        return self.modes.get(feature, "support")

    def _text(self, body: dict) -> str:
        """The reply text: sampled requests vary by seed (or at random when the seed is ignored)."""
        if not body.get("temperature"):
            return self.reply
        seed = body.get("seed")
        if self.mode("seed") == "constant":
            return "always the same"
        if seed is None or self.mode("seed") == "ignore":
            return f"random {uuid.uuid4().hex[:8]}"
        return f"seeded {seed}"

    def answer(self, path: str, body: dict) -> tuple[int, object]:
        """(status, JSON object, or a list of stream chunks for a stream)."""
        for feat, key in (("n", "n"), ("logprobs", "logprobs"), ("seed", "seed"), ("ignore_eos", "ignore_eos"),
                          ("streaming usage", "stream_options")):
            if self.mode(feat) == "reject" and key in body and not (key == "n" and body[key] == 1) \
                    and not (feat == "logprobs" and path.endswith("/v1/completions")):
                return 400, {"error": {"message": f"{key} is not supported", "param": key}}
        if path.endswith("/v1/completions"):
            return self._completion(body)
        max_tokens = int(body.get("max_tokens") or 16)
        forced = body.get("ignore_eos") and self.mode("ignore_eos") == "support"
        count = max_tokens if forced else min(1, max_tokens)
        n = int(body.get("n") or 1)
        n = n if self.mode("n") == "support" else 1
        usage = {"prompt_tokens": 9, "completion_tokens": count, "total_tokens": 9 + count}
        if self.mode("token counts") == "broken":
            usage["total_tokens"] += 5
        finish = "length" if count >= max_tokens else "stop"
        choices = []
        for i in range(n):
            lp = None
            if body.get("logprobs") and self.mode("logprobs") == "support":
                k = int(body.get("top_logprobs") or 0)
                lp = {"content": [{"token": "yes", "logprob": -0.1,
                                   "top_logprobs": [{"token": "yes", "logprob": -0.1}] * k}]}
            choices.append({"index": i, "message": {"role": "assistant", "content": self._text(body)},
                            "finish_reason": finish, "logprobs": lp})
        if body.get("stream"):
            chunks = [{"choices": [{"index": c["index"], "delta": {"content": c["message"]["content"]},
                                    "finish_reason": None}]} for c in choices]
            chunks += [{"choices": [{"index": c["index"], "delta": {}, "finish_reason": finish}]} for c in choices]
            if (body.get("stream_options") or {}).get("include_usage") and self.mode("streaming usage") == "support":
                chunks.append({"choices": [], "usage": usage})
            return 200, chunks
        doc = {"object": "chat.completion", "choices": choices}
        if self.mode("token counts") != "ignore":
            doc["usage"] = usage
        return 200, doc

    def _completion(self, body: dict) -> tuple[int, object]:
        if body.get("echo") and self.mode("echo") == "reject":
            return 400, {"error": {"message": "echo together with logprobs is not supported", "param": "echo"}}
        prompt = str(body.get("prompt"))
        echo = body.get("echo") and self.mode("echo") == "support"
        words = prompt.split(" ")
        tokens = ([words[0]] + [" " + w for w in words[1:]] if echo else []) + [" dog"]
        lp = None
        if body.get("logprobs") is not None:
            lp = {"tokens": tokens, "token_logprobs": [None if echo else -0.5] + [-0.5] * (len(tokens) - 1),
                  "top_logprobs": [None] + [{t: -0.5} for t in tokens[1:]]}
        return 200, {"object": "text_completion",
                     "choices": [{"index": 0, "text": (prompt if echo else "") + " dog", "logprobs": lp,
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": len(words), "completion_tokens": 1, "total_tokens": len(words) + 1}}

    def __enter__(self) -> "FakeCapabilities":
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                self._json(200, {"object": "list", "data": [{"id": "cap-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                if fake.delay_s:
                    time.sleep(fake.delay_s)
                status, obj = fake.answer(self.path, body)
                if not isinstance(obj, list):
                    return self._json(status, obj)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for chunk in obj:
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server, self.thread, self.url = serve(Handler)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.server, self.thread)
