"""Reports of one run and of a comparison, in layers whose imports point one way (down):

    formats      which document and which renderer make each format (text, markdown, json, html)
      │
    text  markdown  html          renderers: a Document in, text out; none imports another
      │
    run  comparison               builders: a RunReport or a Comparison in, Documents out
      │                           (comparison uses run's figures and tables for its page)
    document                      the neutral model: Document, Section, Table, Cell, blocks

Builders and renderers are pure: the caller reads each trace once and passes the records down
(a `compare.Run` carries the records it was read from), so nothing here reads or parses a
file. The JSON format is the Comparison as plain data (`comparison.as_json`), not a document.
`screenshot` is a tool beside them that renders a page and photographs it in a headless browser.
"""
