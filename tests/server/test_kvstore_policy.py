"""Save points, checkpoint texts and eviction order of the disk KV cache (pure functions)."""
from __future__ import annotations

import pytest

from server import kvstore_policy as kp
from server.kvstore_policy import (ANCHOR_BONUS, COLD, CONTINUED, EVICT, HALF_LIFE_S, SHUTDOWN, EntryStats, SavePoint,
                                   SavePolicy)

HOUR = 3600.0


# --- save points ----------------------------------------------------------------------

@pytest.mark.parametrize("n_prompt, boundary, want", [
    (4096, None, 2048),          # 4096 - 32 = 4064 -> aligned down to 2048
    (4128, None, 4096),          # exactly enough room for the trim
    (4127, None, 2048),
    (2079, None, None),
    (2080, None, 2048),
    (1000, None, None),          # too short to be worth a checkpoint
    (5000, 4500, 4500),          # the user-turn boundary wins
    (5000, 100, 4096),           # a boundary that early is no use: aligned point instead
    (5000, 5001, 4096),          # a boundary past the prompt is ignored
])
def test_cold_save_point(n_prompt, boundary, want):
    assert kp.cold_save_point(n_prompt, boundary) == want


def test_continued_points_are_absolute_multiples_of_the_interval():
    assert kp.CONTINUED_INTERVAL == 10240 and kp.CONTINUED_INTERVAL % kp.ALIGN_TOKENS == 0
    assert kp.continued_save_points(0, 35000) == [10240, 20480, 30720]
    # Absolute frontiers: a prefill resumed at 15000 saves at 20480, not at 15000 + 10240.
    assert kp.continued_save_points(15000, 35000) == [20480, 30720]
    assert kp.continued_save_points(10240, 20000) == []          # 20480 is past the end
    assert kp.continued_save_points(0, 10240 + 31) == []         # would cut into the trailing 32
    assert kp.continued_save_points(0, 10240 + 32) == [10240]


def test_plan_prefill_saves_merges_cold_and_continued():
    assert kp.plan_prefill_saves(0, 25000) == [SavePoint(10240, CONTINUED), SavePoint(20480, CONTINUED),
                                               SavePoint(24576, COLD)]
    # The cold point also a continued frontier is saved once, as cold.
    assert kp.plan_prefill_saves(0, 20480 + 32) == [SavePoint(10240, CONTINUED), SavePoint(20480, COLD)]
    assert kp.plan_prefill_saves(0, 25000, user_boundary=24000) == [
        SavePoint(10240, CONTINUED), SavePoint(20480, CONTINUED), SavePoint(24000, COLD)]
    # A continued frontier just past the cold point would duplicate it.
    assert kp.plan_prefill_saves(0, 21000, user_boundary=20000) == [SavePoint(10240, CONTINUED), SavePoint(20000, COLD)]
    # Mostly served from cache: no cold point for a short prefill.
    assert kp.plan_prefill_saves(24000, 25000) == []
    # A long prefill after a restore: the cold point lies beyond what was restored.
    assert kp.plan_prefill_saves(8192, 14000) == [SavePoint(10240, CONTINUED), SavePoint(12288, COLD)]
    assert kp.plan_prefill_saves(0, 1500) == []


def test_plan_with_a_small_policy():
    p = SavePolicy(trim=4, align=16, interval=64, min_tokens=16, min_gain=8)
    assert kp.plan_prefill_saves(0, 150, None, p) == [SavePoint(64, CONTINUED), SavePoint(128, CONTINUED),
                                                      SavePoint(144, COLD)]
    with pytest.raises(ValueError):
        SavePolicy(align=0)


@pytest.mark.parametrize("n_live, n_common, n_saved, want", [
    (6000, 0, 0, True),          # a long session replaced by an unrelated prompt
    (6000, 5900, 0, False),      # the next prompt keeps it in memory
    (6000, 0, 5900, False),      # the disk already holds nearly all of it
    (6000, 0, 4096, True),
    (1000, 0, 0, False),         # too short
])
def test_evict_save_wanted(n_live, n_common, n_saved, want):
    assert kp.evict_save_wanted(n_live, n_common, n_saved) is want


# --- checkpoint text --------------------------------------------------------------------

class CharTokenizer:
    """One token per character, except "ab" which merges: enough to make boundaries unclean."""

    BOS = 0

    def tokenize(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(1)
                i += 2
            else:
                ids.append(ord(text[i]) + 10)
                i += 1
        return ids

    def detokenize(self, ids) -> str:
        return "".join("ab" if t == 1 else "<s>" if t == self.BOS else chr(t - 10) for t in ids)

    def prompt_ids(self, text: str) -> list[int]:
        return [self.BOS] + self.tokenize(text)


def test_prefix_text_at_finds_clean_boundaries():
    tok = CharTokenizer()
    text = "xxab-yy"
    ids = tok.prompt_ids(text)  # BOS x x ab - y y
    kw = dict(detokenize=tok.detokenize, prompt_ids=tok.prompt_ids, bos_id=tok.BOS, tokenize_suffix=tok.tokenize)
    assert kp.prefix_text_at(text, ids, 4, **kw) == (4, "xxab")
    assert kp.prefix_text_at(text, ids, 5, **kw) == (5, "xxab-")


def test_prefix_text_at_moves_down_to_a_clean_boundary():
    tok = CharTokenizer()
    full = "xxab"
    canonical = tok.prompt_ids(full)  # BOS x x ab
    generated = [tok.BOS] + [ord(c) + 10 for c in full]  # BOS x x a b: not how "xxab" tokenizes
    kw = dict(detokenize=tok.detokenize, prompt_ids=tok.prompt_ids, bos_id=tok.BOS)
    assert kp.prefix_text_at(full, generated, 5, **kw) == (4, "xxa")
    assert kp.prefix_text_at(full, generated, 5, exact=False, **kw) == (5, "xxab")
    # With the suffix check the rest must tokenize as in the prompt: "ab" gives one token, not a, b.
    assert kp.prefix_text_at(full, generated, 3, tokenize_suffix=tok.tokenize, **kw) is None
    assert kp.prefix_text_at(full, canonical, 3, tokenize_suffix=tok.tokenize, **kw) == (3, "xx")
    # The search is bounded.
    assert kp.prefix_text_at(full, generated, 5, max_back=1, **kw) is None


def test_prefix_text_at_gives_up_when_no_boundary_is_clean():
    tok = CharTokenizer()
    kw = dict(detokenize=tok.detokenize, prompt_ids=tok.prompt_ids, bos_id=tok.BOS)
    assert kp.prefix_text_at("zzzz", tok.prompt_ids("qqqq"), 4, **kw) is None


def test_tokens_at_text_offset():
    tok = CharTokenizer()
    text = "sys|ab|user"
    ids = tok.prompt_ids(text)
    assert kp.tokens_at_text_offset(text, text.index("user"), ids, tok.prompt_ids) == 7  # BOS s y s | ab |
    assert kp.tokens_at_text_offset(text, text.index("b"), ids, tok.prompt_ids) is None  # inside the "ab" merge
    assert kp.tokens_at_text_offset(text, 0, ids, tok.prompt_ids) is None


# --- eviction ---------------------------------------------------------------------------

def entry(key, reason=CONTINUED, n_tokens=1000, size=1000, hits=0, last_used=0.0) -> EntryStats:
    return EntryStats(key, reason, n_tokens, size, hits, last_used)


def test_effective_hits_half_life_and_floor():
    now = 100 * HOUR
    assert kp.effective_hits(4, now, now) == 4
    assert kp.effective_hits(4, now - HALF_LIFE_S, now) == pytest.approx(2)
    assert kp.effective_hits(4, now - 3 * HALF_LIFE_S, now) == pytest.approx(0.5)
    assert kp.effective_hits(1, now - 6 * HALF_LIFE_S, now) == pytest.approx(1 / 64)
    assert kp.effective_hits(1, now - 7 * HALF_LIFE_S, now) == 0.0  # 1/128 < 0.01


def test_score_formula_and_anchor_bonus():
    now = 10 * HOUR
    e = entry("a", n_tokens=3000, size=2000, hits=2, last_used=now)
    assert kp.eviction_score(e, now) == pytest.approx(3 * 3000 / 2000)
    for reason in (COLD, EVICT, SHUTDOWN):
        assert kp.eviction_score(entry("b", reason, 3000, 2000, 2, now), now) == pytest.approx(ANCHOR_BONUS * 4.5)


def test_order_prefers_tokens_per_byte_then_lru():
    now = 10 * HOUR
    dense = entry("dense", n_tokens=1000, size=1000, last_used=0)
    sparse = entry("sparse", n_tokens=1000, size=3000, last_used=now)
    old = entry("old", last_used=now - 2 * HOUR)
    new = entry("new", last_used=now - HOUR)
    order = [e.key for e in kp.eviction_order([dense, sparse, old, new], now)]
    assert order == ["sparse", "dense", "old", "new"]


def test_decay_lets_an_old_favourite_go():
    now = 100 * HOUR
    favourite = entry("favourite", hits=4, last_used=now - 24 * HOUR)  # 4 hits, 4 half-lives ago: 0.25
    recent = entry("recent", hits=1, last_used=now)
    assert kp.select_victims([favourite, recent], 1000, now) == ["favourite"]
    # Without the passage of time the favourite would stay.
    assert kp.select_victims([favourite, recent], 1000, now - 24 * HOUR + 1) == ["recent"]


def test_anchor_outlives_a_more_recent_continued_entry():
    now = 10 * HOUR
    cold = entry("cold", COLD, last_used=now - HOUR)
    cont = entry("cont", CONTINUED, last_used=now)
    assert kp.select_victims([cold, cont], 1000, now) == ["cont"]


def test_select_victims_respects_protection_and_budget():
    now = 10 * HOUR
    entries = [entry(k, last_used=i) for i, k in enumerate("abcd")]
    assert kp.select_victims(entries, 4000, now) == []
    assert kp.select_victims(entries, 2500, now) == ["a", "b"]
    assert kp.select_victims(entries, 2500, now, protected={"a"}) == ["b", "c"]
    # Protected entries alone over the budget: they stay, everything else goes.
    assert kp.select_victims(entries, 500, now, protected={"a", "b"}) == ["c", "d"]


def test_fits_budget_has_a_one_percent_margin():
    assert kp.fits_budget(990, 1000)
    assert not kp.fits_budget(991, 1000)


def test_space_deficit_counts_the_new_entry_and_the_minimum_free():
    assert kp.space_deficit(free_bytes=10_000, min_free_bytes=2_000, incoming_bytes=3_000) == 0
    assert kp.space_deficit(free_bytes=4_000, min_free_bytes=2_000, incoming_bytes=3_000) == 1_000
    assert kp.space_deficit(free_bytes=0, min_free_bytes=0, incoming_bytes=500) == 500


def test_victims_for_space_take_the_eviction_order_until_the_files_cover_the_need():
    now = 10 * HOUR
    entries = [entry(k, last_used=i) for i, k in enumerate("abcd")]  # 1000 bytes each, oldest first
    assert kp.victims_for_space(entries, 0, now) == []
    assert kp.victims_for_space(entries, 1, now) == ["a"]
    assert kp.victims_for_space(entries, 1500, now) == ["a", "b"]
    assert kp.victims_for_space(entries, 1500, now, protected={"a"}) == ["b", "c"]
    # What the evictable entries hold is not enough: None, so that nothing is deleted in vain.
    assert kp.victims_for_space(entries, 3500, now, protected={"d"}) is None
    assert kp.victims_for_space([], 1, now) is None
