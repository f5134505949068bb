"""The README's main command, run in-process: its numbers and its identity check."""

from lmcache_hma.tools.repro import DEFAULT_CONFIG, run_repro
from tests.engines import counting_repro_starts


def test_repro_reloads_5888_tokens_exactly(capfd, monkeypatch):
    counting_repro_starts(monkeypatch)
    result = run_repro(None, DEFAULT_CONFIG)
    rows = result["rows"]
    assert [r["total"] for r in rows] == [30006, 30007, 30007, 6007]
    assert [r["hit"] for r in rows[:3]] == [0, 0, 0]
    assert rows[-1]["hit"] == rows[-1]["loaded"] == 5888
    assert result["evicted"] and result["identical"]
    err = capfd.readouterr().err
    assert "Total tokens 6007, LMCache hit tokens: 5888, need to load: 5888" in err
