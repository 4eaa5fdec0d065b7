"""Reports of one run or of a comparison: tables (`run`, `comparison`), the HTML page (`html`),
which renderer writes which format (`formats`) and a headless-browser screenshot (`screenshot`).

Renderers are pure (records or a Comparison in, text out); only `screenshot` starts a browser.
"""
