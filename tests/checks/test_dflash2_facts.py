"""dflash2_facts on constructed runs: a DFlash2 config passes only where the engine read back a
DFlash2 drafter with its selector on and a block that holds K + 1 tokens."""
from __future__ import annotations

import pytest

from speccheck.evaluate import evaluate_suite
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.types import RunRecord, SpecConfig
from tests.test_evaluate import BASE, DFLASH_COUNTERS, comp


def _judge(tmp_path, identity: dict, name: str = "dflash2-k7"):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    s.write_run(RunRecord(SpecConfig(), {"engine": "t"}, "c", "h", 0, False,
                          completions=[comp(p, t) for p, t in BASE.items()]))
    s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t", **identity}, "c", "h", 0, False,
                          completions=[comp(p, t, spec=DFLASH_COUNTERS) for p, t in BASE.items()]))
    res = evaluate_suite(s, Policy(require_deterministic=False), ["baseline", name])
    assert "dflash2_facts" not in [c.name for c in res.get("baseline").checks]
    return res.get(name).check("dflash2_facts")


@pytest.mark.parametrize("identity, passed, says", [
    ({"block_size": 8, "dflash2": {"selector": "on", "top_k": 16}}, True, "selector on"),
    ({"block_size": 8, "dflash2": {"selector": "off", "top_k": 16}}, False, "selector was 'off'"),
    ({"block_size": 8}, False, "no DFlash2 drafter"),
    ({"block_size": 4, "dflash2": {"selector": "on"}}, False, "drafts past the block"),
    ({"draft_block": 6, "dflash2": {"selector": "on"}}, False, "block was 6 tokens, not K + 1 = 8"),
])
def test_what_the_engine_read_back_decides(tmp_path, identity, passed, says):
    c = _judge(tmp_path, identity)
    assert c.passed is passed and says in c.message, c.message
