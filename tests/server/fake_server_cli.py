"""`python tests/server/fake_server_cli.py [ds4-server flags]`: the real ds4-server command line
with the scripted fake engine (`server_fake_engine.FakeModel`) in place of the model, for tests
that need a server process (its sockets, its logging, its exit status) but no weights.

`engine.load_model` returns a fake model whose path is `--model` (default
/models/fake-model.gguf) and the app is built with the fake engine's types; everything else
is `server.cli.main` as installed.
"""

from __future__ import annotations

import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # server_fake_engine, engine_fakes

import engine  # noqa: E402
import server.app  # noqa: E402
from server.cli import main  # noqa: E402
from server_fake_engine import FAKE_ENGINE, FakeModel  # noqa: E402


def load_fake(path: str | None = None, **_: object) -> FakeModel:
    return FakeModel(path=path or "/models/fake-model.gguf")


engine.load_model = load_fake
server.app.create_app = functools.partial(server.app.create_app, engine=FAKE_ENGINE)

if __name__ == "__main__":
    sys.exit(main())
