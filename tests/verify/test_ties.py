"""Canonical ties: exactly tied top-k entries are ordered as greedy argmax breaks them (lowest
id first) by every engine's parsing, so the same numbers give the same agreement and classes
whichever engine stored them; an exact tie classifies as the closest near-tie."""
import copy
import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.engines.openai import completion_from_choice, scored_from_prompt_logprobs
from speccheck.engines.vllm import completion_from_dict, scored_from_dict
from speccheck.types import Prompt
from speccheck.verify import (canonical_rows, canonical_topk, classify_divergence,
                              teacher_forced_agreement, teacher_forced_divergences)

FIX = Path(__file__).parents[1] / "fixtures" / "vllm"


def test_canonical_topk_orders_ties_by_lowest_id():
    # vLLM 0.26's top-k on a three-way bf16 tie seen on the H200: 3895, 3023, 312; greedy took 312
    pairs = [(3895, -3.12999), (3023, -3.12999), (312, -3.12999), (9, float("nan")), (40, -4.0)]
    assert [t for t, _ in canonical_topk(pairs)] == [312, 3023, 3895, 40, 9]
    assert [t for t, _ in canonical_topk(pairs, 2)] == [312, 3023]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from([-1.0, -2.0, -2.5, -7.0])),
                min_size=2, max_size=8, unique_by=lambda x: x[0]), st.randoms())
def test_canonical_rows_ignore_the_listed_order(pairs, rnd):
    shuffled = list(pairs)
    rnd.shuffle(shuffled)
    a = canonical_rows(np.array([[t for t, _ in pairs]]), np.array([[lp for _, lp in pairs]], np.float32))
    b = canonical_rows(np.array([[t for t, _ in shuffled]]), np.array([[lp for _, lp in shuffled]], np.float32))
    assert a[0].tolist() == b[0].tolist() == [[t for t, _ in canonical_topk(pairs)]]
    assert a[0][0, 0] == min(t for t, lp in pairs if lp == max(x for _, x in pairs))  # greedy's pick


def test_exact_tie_is_the_closest_near_tie_whatever_the_listed_order():
    """Baseline greedy took 312 of a three-way tie; spec took 3895, listed third."""
    b_ids, b_lp = np.array([312, 3023, 3895, 7, 8]), np.array([-3.13, -3.13, -3.13, -5.0, -6.0])
    s_ids, s_lp = np.array([3895, 312, 3023, 7, 8]), np.array([-3.12, -3.14, -3.14, -5.0, -6.0])
    c = classify_divergence(312, 3895, b_ids, b_lp, s_ids, s_lp, tau_tie=0.001, tau_low=0.05, max_gap=0.05)
    assert c.cls == "near_tie" and c.base_margin == 0.0
    # a token merely third, not tied, stays what it was (margin within tau_tie, but not second)
    c = classify_divergence(312, 3895, b_ids, np.array([-3.13, -3.135, -3.14, -5, -6]), s_ids, s_lp,
                            tau_tie=0.01, tau_low=0.05, max_gap=0.05)
    assert c.cls == "low_confidence"


def _tied_generation() -> tuple[dict, list[int]]:
    """The real vLLM MTP K=3 output of the fixture with an exact three-way tie planted at the top
    of two positions; the spec token there is the tied token with the highest id."""
    row = json.loads((FIX / "mtp_k3.json").read_text())["row"]
    row = copy.deepcopy(row)
    out = row["output"]["outputs"][0]
    for pos in (2, 5):
        entries = out["logprobs"][pos]
        ranked = sorted(entries, key=lambda t: entries[t]["rank"])
        top = entries[ranked[0]]["logprob"]
        for t in ranked[:3]:
            entries[t]["logprob"] = top
        out["token_ids"][pos] = max(int(t) for t in ranked[:3])
    return row, out["token_ids"]


def _server_dicts(positions: list[dict]) -> list[dict]:
    """As an OpenAI server lists them: tied entries in reverse id order (any order is legal)."""
    return [dict(sorted(((f"token_id:{t}", v["logprob"]) for t, v in pos.items()),
                        key=lambda kv: (-kv[1], -int(kv[0].split(":")[1])))) for pos in positions]


def test_openai_and_vllm_parsing_agree_on_byte_identical_numbers():
    row, tokens = _tied_generation()
    k = 5
    out = row["output"]["outputs"][0]
    prompt = Prompt("p", "code", len(tokens), text="x")
    offline = completion_from_dict("p", row, k, spec=False)
    choice = {"text": "", "finish_reason": "length", "token_ids": tokens,
              "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                           "token_logprobs": [out["logprobs"][i][str(t)]["logprob"] for i, t in enumerate(tokens)],
                           "top_logprobs": _server_dicts(out["logprobs"])}}
    served = completion_from_choice(prompt, row["output"]["prompt_token_ids"], choice, k, 0.1, None)
    assert served.topk_ids.tolist() == offline.topk_ids.tolist()
    np.testing.assert_array_equal(served.topk_logprobs, offline.topk_logprobs)

    # the baseline's teacher-forced scores of this output: the same numbers as prompt logprobs
    # (greedy on the tie = the lowest id; the spec token there is the highest of the three)
    prompt_ids = row["output"]["prompt_token_ids"]
    full = prompt_ids + tokens
    plp = [None] * len(prompt_ids) + [
        {t: {"logprob": v["logprob"], "rank": r + 1} for r, (t, v) in
         enumerate(sorted(pos.items(), key=lambda kv: (-kv[1]["logprob"], -int(kv[0]))))}
        for pos in out["logprobs"]]
    s_off = scored_from_dict({"output": {"prompt_token_ids": full, "prompt_logprobs": plp}}, len(prompt_ids), k)
    s_srv = scored_from_prompt_logprobs(plp, full, len(prompt_ids), k)
    assert s_srv.topk_ids.tolist() == s_off.topk_ids.tolist()

    a_off = teacher_forced_agreement(offline.token_ids, s_off.topk_ids)
    a_srv = teacher_forced_agreement(served.token_ids, s_srv.topk_ids)
    assert a_off.tolist() == a_srv.tolist() and np.flatnonzero(~a_off).tolist() == [2, 5]
    args = (0.02, 0.1, 0.01)
    d_off = teacher_forced_divergences("p", offline.token_ids, offline.topk_ids, offline.topk_logprobs,
                                       s_off.topk_ids, s_off.topk_logprobs, *args, max_gap=0.1)
    d_srv = teacher_forced_divergences("p", served.token_ids, served.topk_ids, served.topk_logprobs,
                                       s_srv.topk_ids, s_srv.topk_logprobs, *args, max_gap=0.1)
    assert [(d.position, d.cls) for d in d_off] == [(d.position, d.cls) for d in d_srv] \
        == [(2, "near_tie"), (5, "near_tie")]
