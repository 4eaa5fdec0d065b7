"""`--repeats 3 --temp 0.7` on a few sanity cases of the embedded model: the report lists flaky
cases (needs the weights: marked `model`)."""

import re

import pytest
from click.testing import CliRunner

from ds4eval import cli

# Multiple-choice cases whose sampled answers at seed 1 differ between repeats within a few
# tokens (choice-ice: repeat 0 picks A in 16 tokens, repeat 2 answers without a letter in 17).
CASES = ("choice-sky-colour", "choice-ice", "choice-sun")


@pytest.mark.model
def test_sampled_repeats_report_flaky_cases(tmp_path):
    args = ["--plain", "--repeats", "3", "--temp", "0.7", "--seed", "1", "--tokens", "24", "--parallel", "3",
            "--trace", str(tmp_path / "r.trace")]
    for c in CASES:
        args += ["--case-id", c]
    r = CliRunner().invoke(cli.main, args)
    assert r.exit_code == 0, r.output
    m = re.search(r"repeats 3: stable pass (\d+), stable fail (\d+), flaky (\d+)", r.output)
    assert m and sum(map(int, m.groups())) == len(CASES), r.output
    flaky = re.findall(r"flaky sanity/([\w-]+): ([12])/3 passed", r.output)
    assert int(m[3]) == len(flaky) >= 1, r.output
