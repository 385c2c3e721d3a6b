"""concurrent_identical judged like agreement: identical concurrent requests that split are
classified by margin; near-tie (and exact-tie) splits pass by default, high-confidence ones
fail; strict mode fails any split; where the baseline splits too, the report says the engine is
not batch-invariant at ties and a spec config is judged against that."""
import numpy as np

from speccheck.checks._text import NOT_INVARIANT
from speccheck.evaluate import evaluate_suite
from speccheck.gate import exit_code
from speccheck.policy import Policy
from speccheck.report import diff_text, markdown_report
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters

V = 60
TOKENS = {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13, 14, 15, 16]}
TIE = ("a", 3)  # an exact three-way tie: tokens 8, 30, 31 at the same logprob


def _comp(pid, tokens, spec=None):
    n = len(tokens)
    ids = np.array([[t, (t + 1) % V, (t + 2) % V, (t + 3) % V, (t + 4) % V] for t in tokens], np.int32)
    lp = np.tile(np.array([-0.5, -3.5, -6, -7, -8], np.float32), (n, 1))
    if pid == TIE[0]:
        p = TIE[1]
        ids[p] = [min(tokens[p], 30), 30 if tokens[p] != 30 else 8, 31, 40, 41]
        lp[p] = [-1.2, -1.2, -1.2, -6, -7]
    return Completion(pid, [1, 2], tokens, lp[np.arange(n), 0], ids, lp, ttft_s=0.01, decode_s=0.1, spec=spec)


def _corpus(spec=None, a=None, b=None):
    return [_comp("a", a or TOKENS["a"], spec), _comp("b", b or TOKENS["b"], spec)]


def _suite(tmp_path, base_copies, spec_copies):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    counters = SpecCounters(4, 12, 8, [4, 3, 1])
    for name, copies in (("baseline", base_copies), ("mtp-k3", spec_copies)):
        spec = counters if name != "baseline" else None
        for r in (0, 1):
            s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t"}, "c", "h", r, False,
                                  completions=_corpus(spec)))
        s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t"}, "c", "h", -1, False,
                              completions=[c for cp in copies for c in cp], copies=len(copies)))
        s.write_rescore(name, 0, list(TOKENS), [Scored(c.topk_ids, c.topk_logprobs, c.logprobs)
                                               for c in _corpus()])
    return s


TIED = TOKENS["a"][:3] + [30, 9, 10]  # the other of the tied tokens, then the same text
WILD = TOKENS["b"][:2] + [50, 51, 52, 53]  # a token far outside the top-k


def test_exact_tie_split_passes_by_default_and_shows_its_margin(tmp_path):
    s = _suite(tmp_path, [_corpus(), _corpus()], [_corpus(), _corpus(a=TIED)])
    res = evaluate_suite(s, Policy(min_token_agreement=0.5))
    c = res.get("mtp-k3").check("concurrent_identical")
    assert c.passed and "a: 2 distinct" in c.message
    assert "prompt a position 3" in c.message and "baseline margin 0.000 nats" in c.message \
        and "near_tie" in c.message
    assert "prompt a position 3" in diff_text(res) and "## Concurrent splits" in markdown_report(res)
    strict = evaluate_suite(s, Policy(min_token_agreement=0.5, require_concurrent_identical=True))
    assert not strict.get("mtp-k3").check("concurrent_identical").passed


def test_high_confidence_split_fails(tmp_path):
    s = _suite(tmp_path, [_corpus(), _corpus()], [_corpus(), _corpus(b=WILD)])
    res = evaluate_suite(s, Policy(min_token_agreement=0.5))
    c = res.get("mtp-k3").check("concurrent_identical")
    assert not c.passed and "prompt b position 2" in c.message and "high_confidence" in c.message
    assert exit_code(res) == 1


def test_baseline_split_is_reported_and_spec_judged_against_it(tmp_path):
    s = _suite(tmp_path, [_corpus(), _corpus(a=TIED)], [_corpus(), _corpus(a=TIED)])
    res = evaluate_suite(s, Policy(min_token_agreement=0.5))
    base, spec = res.get("baseline"), res.get("mtp-k3")
    assert base.check("concurrent_identical").passed and NOT_INVARIANT in base.check("concurrent_identical").message
    assert spec.check("concurrent_identical").passed and "the baseline is not batch-invariant either" in spec.check("concurrent_identical").message
    strict = evaluate_suite(s, Policy(min_token_agreement=0.5, require_concurrent_identical=True))
    assert not strict.get("baseline").check("concurrent_identical").passed  # strict: any split
    assert strict.get("mtp-k3").check("concurrent_identical").passed  # ... but not held against spec
    # a high-confidence split still fails, baseline splitting or not
    s2 = _suite(tmp_path / "2", [_corpus(), _corpus(a=TIED)], [_corpus(), _corpus(b=WILD)])
    assert not evaluate_suite(s2, Policy(min_token_agreement=0.5)).get("mtp-k3").check("concurrent_identical").passed
