"""The fleet example's proxy (examples/fleet/proxy.py): how it weighs the index's answer and
breaks ties. The index itself is Dynamo's (tests/test_e2e_fleet_index.py runs the real one);
here its answer is given, to check the choice alone."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "fleet"))

import proxy  # noqa: E402

INSTANCES = {1: "http://127.0.0.1:1", 2: "http://127.0.0.1:2", 3: "http://127.0.0.1:3"}


class Given(proxy.Fleet):
    def __init__(self, answers):
        super().__init__(INSTANCES, "http://index", "kv")
        self.answers = list(answers)

    def query(self, tokens):
        return self.answers.pop(0)


def test_tier_weights_count_each_tokens_best_tier_once():
    # the index's counts are cumulative: cpu includes gpu, disk includes both
    assert proxy.tier_weighted({"gpu": 256, "cpu": 1024, "disk": 2048}) == 256 + 0.75 * 768 + 0.25 * 1024


def test_prompts_no_instance_holds_spread_over_the_fleet():
    front = Given([{}] * 6)
    picks = [front.choose("/v1/completions", {"prompt": [1, 2, 3]}) for _ in range(6)]
    assert sorted(picks[:3]) == [1, 2, 3] and picks[3:] == picks[:3], picks


def test_the_instance_that_restores_most_wins_unless_busy():
    held = {"2": {"longest_matched": 1024, "gpu": 0, "cpu": 1024, "disk": 1024}}
    front = Given([held, held])
    assert front.choose("/v1/completions", {"prompt": [1, 2, 3]}) == 2
    front.begin(2)
    front.begin(2)  # two requests in flight there outweigh 768 restorable tokens (512 each)
    assert front.choose("/v1/completions", {"prompt": [1, 2, 3]}) != 2


def test_a_short_shared_head_does_not_pull_new_prompts_to_one_instance():
    """A system prompt all conversations share (256 of 700 tokens held by instance 1) is under
    the cache threshold: each new conversation goes where the least was computed, not to 1."""
    head = {"1": {"longest_matched": 256, "gpu": 256, "cpu": 256, "disk": 256}}
    front = Given([head] * 3)
    picks = [front.choose("/v1/completions", {"prompt": list(range(700))}) for _ in range(3)]
    assert sorted(picks) == [1, 2, 3], picks
    front = Given([head])
    front.cache_threshold = 0.3  # 256 of 700 is enough here
    assert front.choose("/v1/completions", {"prompt": list(range(700))}) == 1
