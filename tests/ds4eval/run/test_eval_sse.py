"""ds4eval.run.sse: one data line in, DONE / an event object / nothing out, or a reason to fail."""
from __future__ import annotations

import pytest

from ds4eval.run.sse import DONE, StreamFault, decode_data_line


@pytest.mark.parametrize("line", ["", ": prefill", "event: message_start", "id: 4"])
def test_lines_without_data_are_skipped(line):
    assert decode_data_line(line) is None


def test_done_and_objects():
    assert decode_data_line("data: [DONE]") == DONE
    assert decode_data_line('data: {"choices": []}\r') == {"choices": []}


@pytest.mark.parametrize("line, reason", [
    ("data: {broken", "broken JSON"),
    ("data: [1, 2]", "not a JSON object"),
    ('data: {"error": {"message": "worker died"}}', "worker died"),
    ('data: {"error": "overloaded"}', "overloaded"),
])
def test_faults_name_the_reason(line, reason):
    with pytest.raises(StreamFault, match=reason):
        decode_data_line(line)
