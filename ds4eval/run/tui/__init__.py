"""The live terminal UI of `ds4-eval` (curses), used when stdout is a terminal and `--plain` is
not given.

Modules: `text` (cell widths, clipping and wrapping of arbitrary text), `view` (event listener and
the immutable view of a run), `render` (pure layout: view in, positioned styled text out) and
`app` (the curses shell: keys, resize, runner thread, terminal restore). Only `app` touches the
terminal. See `run_with_ui` for the entry point.
"""

from ds4eval.run.tui.app import UIOutcome, UISettings, run_with_ui, terminal_ui_available

__all__ = ["UIOutcome", "UISettings", "run_with_ui", "terminal_ui_available"]
