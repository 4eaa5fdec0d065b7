"""The server tests' view of the one engine fake (`tests/engine_fakes.py`): ChatML without
thinking tokens, a 1,024-token context and a greeting as the default reply, so that the
byte-level token counts the server tests predict stay what they were."""

from __future__ import annotations

import engine_fakes
from engine_fakes import CHATML, FAKE_ENGINE  # noqa: F401 - re-exported for the server tests

DEFAULT_REPLY = "Hello, world! This is the scripted reply."


class FakeModel(engine_fakes.FakeModel):
    def __init__(self, reply=DEFAULT_REPLY, *, n_ctx: int = 1024, **kw) -> None:
        kw.setdefault("vocab", CHATML)
        super().__init__(reply, n_ctx=n_ctx, **kw)
