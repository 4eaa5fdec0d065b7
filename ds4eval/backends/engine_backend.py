"""Engine backend: runs cases in-process through the `engine` package's public API.

Contract
- `EngineBackend(model)` wraps any object following the engine API (load_model's result);
  `EngineBackend.load(config)` loads one. One session is reused across cases so the shared
  system-prompt prefix is prefilled once.
- Budget: min(job.max_tokens, n_ctx - prompt tokens), counting injected think-close tokens;
  the session never holds more than n_ctx tokens. A prompt that leaves no room is SKIPPED.
- Thinking: on when the job asks for it and the model has a single-token `</think>`. If the
  model is still thinking when few budget tokens remain it first gets a nudge to conclude
  (think_close "soft"), then the block is closed for it and the answer requested ("hard").
  The recorded output starts with `<think>` when the prompt opened the block, so extraction
  sees exactly what the model's reply contains.
It does not grade, write traces or talk HTTP.
"""

from __future__ import annotations

from ds4eval import prompts
from ds4eval.config import EvalConfig
from ds4eval.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.runner import CaseContext, GenerationJob, GenerationResult


def model_supports_thinking(model) -> bool:
    """True when `</think>` is one special token (the template can then toggle thinking)."""
    try:
        return len(model.tokenize(THINK_CLOSE, special=True)) == 1 and \
            len(model.tokenize(THINK_OPEN, special=True)) == 1
    except Exception:
        return False


class EngineBackend:
    name = "engine"
    max_concurrency = 1

    def __init__(self, model, api=None):
        """`api` is the module providing SamplingParams and Cancelled (default: `engine`)."""
        if api is None:
            import engine as api
        self.api = api
        self.model = model
        self.model_name = model.name
        self.n_ctx = model.n_ctx
        self.supports_thinking = model_supports_thinking(model)
        self._session = None

    @classmethod
    def load(cls, config: EvalConfig) -> "EngineBackend":
        import engine

        return cls(engine.load_model(config.model, ctx=config.ctx, device=config.device), engine)

    def render(self, job: GenerationJob, think: bool) -> str:
        messages = [{"role": "system", "content": job.system_prompt},
                    {"role": "user", "content": job.question_prompt}]
        extra = {"enable_thinking": think} if self.supports_thinking else {}
        return self.model.render_chat(messages, add_generation_prompt=True, **extra)

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.model.tokenize(text, special=True)
        if getattr(self.model, "add_bos", False) and (not ids or ids[0] != self.model.bos_id):
            ids = [self.model.bos_id] + ids
        return ids

    def run_case(self, job: GenerationJob, ctx: CaseContext) -> GenerationResult:
        engine = self.api
        think = job.think and self.supports_thinking
        text = self.render(job, think)
        ids = self.prompt_ids(text)
        n_prompt = len(ids)
        res = GenerationResult(prompt_tokens=n_prompt, thinking=think)
        budget = min(job.max_tokens, self.n_ctx - n_prompt)
        if budget <= 0:
            res.skipped = f"prompt has {n_prompt} tokens, context is {self.n_ctx}: no room to answer"
            return res
        if self._session is None:
            self._session = self.model.new_session()
        session = self._session

        ctx.prefill(0, n_prompt)
        try:
            session.sync(ids, progress=ctx.prefill, cancel=lambda: ctx.checkpoint() is not None)
        except engine.Cancelled:
            res.interrupted = ctx.checkpoint() or "stop"
            return res
        ctx.started(n_prompt)

        params = engine.SamplingParams(temperature=job.temperature, top_p=job.top_p, min_p=job.min_p,
                                       seed=job.seed)
        stream = self.model.text_stream()
        out: list[str] = []
        in_think = False
        if think and text.rstrip().endswith(THINK_OPEN):
            in_think = True
            out.append(THINK_OPEN + "\n")
            ctx.text(out[-1], True)
        soft_reserve = min(job.think_soft_reserve, budget // 4)
        hard_reserve = min(job.think_hard_reserve, budget // 8)
        close_kind = "none"
        used = 0          # budget spent: sampled plus injected tokens
        sampled = 0

        tail = ""  # last few characters, so a marker split across pieces is still seen

        def emit(piece: str) -> None:
            nonlocal in_think, close_kind, tail
            if not piece:
                return
            was = in_think
            out.append(piece)
            if think:
                window = tail + piece
                if not in_think:
                    j = window.rfind(THINK_OPEN)
                    if j >= 0 and THINK_CLOSE not in window[j:]:
                        in_think = True
                elif THINK_CLOSE in window:
                    in_think = False
                    if close_kind == "none":
                        close_kind = "natural"
                tail = window[-len(THINK_CLOSE):]
            ctx.text(piece, was or in_think)

        def inject(s: str) -> int:
            toks = self.model.tokenize(s, special=True)
            for t in toks:
                session.eval(t)
                emit(stream.push(t))
            return len(toks)

        while used < budget:
            why = ctx.checkpoint()
            if why:
                res.interrupted = why
                break
            left = budget - used
            if in_think and left <= hard_reserve:
                n_inj = len(self.model.tokenize(prompts.THINK_HARD_CLOSE, special=True))
                if n_inj < left:
                    used += inject(prompts.THINK_HARD_CLOSE)
                    close_kind = "hard"
                    in_think = False
                    continue
            elif in_think and close_kind == "none" and left <= soft_reserve:
                n_inj = len(self.model.tokenize(prompts.THINK_SOFT_NUDGE, special=True))
                if n_inj + hard_reserve < left:
                    used += inject(prompts.THINK_SOFT_NUDGE)
                    close_kind = "soft"
                    continue
            tok = session.sample(params)
            used += 1
            sampled += 1
            ctx.token()
            if tok in self.model.eos_ids:
                break
            emit(stream.push(tok))
            if used < budget:
                session.eval(tok)
        emit(stream.flush())
        if in_think:
            close_kind = "unclosed"
        res.output = "".join(out)
        res.gen_tokens = sampled
        res.think_close = close_kind if think else "none"
        return res
