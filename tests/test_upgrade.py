"""`speccheck upgrade OLD NEW`: two constructed stores of one corpus, as two engine versions
would write them, with faults planted in the new one (an acceptance fall of the reported size,
a confident output change, a slowdown, an axis no longer exercised); two clean stores pass,
showing at most classified near-ties."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, SpecConfig, SpecCounters
from speccheck.upgrade import upgrade_suites
from tests.test_evaluate import V, complete_as_run_would, dist

PROMPTS = [f"p{i:02d}" for i in range(20)]
CONFIGS = {"baseline": 0, "mtp-k3": 3, "dflash2-k7": 7}
#: per-position acceptance rates of each method (falling with the position, as drafts do)
RATES = {3: [0.82, 0.63, 0.47], 7: [0.86, 0.72, 0.6, 0.49, 0.39, 0.3, 0.22]}
NEAR_AT = 5  # every prompt's position 5 is a near-tie (runner-up within 0.01 nats)


def tokens(i: int, n: int = 24) -> list[int]:
    return [(7 * i + 3 * j + 1) % V for j in range(n)]


def counters(i: int, k: int, scale: float = 1.0, jitter: int = 0) -> SpecCounters:
    """A prompt's counters: drafts vary by prompt, and so does how easy the prompt is;
    ``jitter`` (a seed) moves some prompts' counts by one, as another kernel path would."""
    drafts = 8 + i % 5
    ease = 0.8 + 0.4 * ((i * 37) % 10) / 10
    wobble = np.random.default_rng(jitter * 100 + i).integers(-1, 2, k) if jitter else np.zeros(k, int)
    per = [max(0, min(drafts, int(round(drafts * min(1.0, r * ease) * scale)) + int(w)))
           for r, w in zip(RATES[k], wobble)]
    for j in range(1, k):  # accepted counts never rise along the draft
        per[j] = min(per[j], per[j - 1])
    return SpecCounters(drafts, drafts * k, sum(per), per)


def tokens_per_iteration(store_counters: list[SpecCounters]) -> float:
    return 1 + sum(c.accepted_tokens for c in store_counters) / sum(c.drafts for c in store_counters)


def completion(pid: str, toks: list[int], spec=None, decode_s: float = 0.2, flip: bool = False,
               confident: bool = False) -> Completion:
    ids, lp = dist(toks, near={NEAR_AT})
    toks = list(toks)
    if flip:  # this side chose the runner-up at the near-tie
        toks[NEAR_AT] = int(ids[NEAR_AT, 1])
        ids[NEAR_AT, [0, 1]] = ids[NEAR_AT, [1, 0]]
    if confident:  # this side chose a token the other side gave 3 nats less
        toks[2] = int(ids[2, 1])
        ids[2, [0, 1]] = ids[2, [1, 0]]
    return Completion(pid, [1, 2, 3], toks, lp[:, 0], ids, lp, text="", ttft_s=0.01,
                      decode_s=decode_s, spec=spec)


def make_store(path, version: str, *, accept_scale: dict | None = None, slow: float = 1.0,
               flip: str | None = None, confident: str | None = None, proof_batch: int = 4,
               jitter: int = 0):
    """A suite as the vLLM engine would store it under ``version``: baseline, mtp-k3 and
    dflash2-k7 over 20 prompts, 2 repeats, and the concurrency axis of mtp-k3. ``flip``: the
    config whose first prompt took the runner-up at a near-tie; ``confident``: the config whose
    first prompt changed a confident token."""
    s = Store(path).suite("s", {"corpus_hash": "h", "engine": "vllm", "corpus": "c"})
    ident = {"engine": "vllm", "version": version, "vllm_version": version, "device": "GPU",
             "model_hash": "m", "tokenizer_hash": "t"}
    for name, k in CONFIGS.items():
        speed = {0: 0.2, 3: 0.11, 7: 0.09}[k] * (slow if name != "baseline" else 1.0)
        for r in (0, 1):
            comps = [completion(p, tokens(i), None if not k else
                                counters(i, k, (accept_scale or {}).get(name, 1.0), jitter),
                                decode_s=speed * (1 + 0.01 * (i % 3)),
                                flip=(name == flip and i == 0), confident=(name == confident and i == 0))
                     for i, p in enumerate(PROMPTS)]
            s.write_run(RunRecord(SpecConfig.from_name(name), ident, "c", "h", r, r == 1, completions=comps))
    axis = [completion(p, tokens(i), counters(i, 3), decode_s=0.1) for i, p in enumerate(PROMPTS[:8])]
    s.write_run(RunRecord(SpecConfig.from_name("mtp-k3"), ident, "c", "h", 0, False, completions=axis,
                          axis="concurrency", level="4",
                          proof={"max_batch": proof_batch, "requests_served": 8}))
    complete_as_run_would(s)
    return s


def judge(tmp_path, **new_faults):
    old = make_store(tmp_path / "old", "0.26.0")
    new = make_store(tmp_path / "new", "0.28.0", **new_faults)
    return upgrade_suites(old, new, list(CONFIGS), Policy())


def test_two_clean_stores_pass(tmp_path):
    u = judge(tmp_path)
    assert u.passed, u.problems
    assert (u.old_version, u.new_version) == ("0.26.0", "0.28.0")
    for c in u.configs.values():
        assert c.outputs.exact == c.outputs.prompts == 20
        assert c.acceptance is None or c.acceptance.overall.direction == "same"
    assert [a.slot for a in u.axes] == ["axis-concurrency-4"] and not u.axes[0].problems


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_clean_stores_whose_counters_wobble_pass(tmp_path, seed):
    """Another version's kernels move a few prompts' accepted counts by one either way: no
    acceptance finding (five seeds; alpha 0.01 over the family)."""
    u = judge(tmp_path, jitter=seed)
    assert u.passed, u.problems
    assert u.configs["dflash2-k7"].acceptance.overall.diff != 0


def test_clean_stores_with_a_near_tie_flip_pass_and_show_it(tmp_path):
    u = judge(tmp_path, flip="dflash2-k7")
    assert u.passed, u.problems
    divs = u.configs["dflash2-k7"].outputs.divergences
    assert [(d.prompt_id, d.position, d.cls) for d in divs] == [("p00", NEAR_AT, "near_tie")]


def test_acceptance_fall_of_15_percent_fails(tmp_path):
    """The reported regression (DFlash2 3.19 -> 2.66 tokens/iteration after an upgrade) at
    its size: tokens/iteration 15 % lower in the new store."""
    old_t = tokens_per_iteration([counters(i, 7) for i in range(20)])
    scale = (0.85 * old_t - 1) / (old_t - 1)  # accepted tokens that make tokens/iteration 15 % lower
    new_t = tokens_per_iteration([counters(i, 7, scale) for i in range(20)])
    assert new_t / old_t - 1 == pytest.approx(-0.15, abs=0.01)
    u = judge(tmp_path, accept_scale={"dflash2-k7": scale})
    assert not u.passed
    d2 = u.configs["dflash2-k7"]
    assert d2.acceptance.overall.direction == "fell"
    assert d2.acceptance.overall.relative == pytest.approx(-0.15, abs=0.01)
    assert any("acceptance fell at tokens/iteration" in p for p in d2.problems)
    assert u.configs["mtp-k3"].passed and u.configs["baseline"].passed


def test_acceptance_that_rose_fails_too(tmp_path):
    u = judge(tmp_path, accept_scale={"mtp-k3": 1.15})
    assert not u.configs["mtp-k3"].passed
    assert u.configs["mtp-k3"].acceptance.rose


def test_confident_output_change_fails(tmp_path):
    u = judge(tmp_path, confident="baseline")
    assert not u.passed and any("high-confidence" in p for p in u.configs["baseline"].problems)


def test_slowdown_fails(tmp_path):
    u = judge(tmp_path, slow=1.3)
    assert not u.configs["mtp-k3"].passed
    assert any("tok/s" in p for p in u.configs["mtp-k3"].problems)
    assert u.configs["baseline"].passed


def test_axis_not_exercised_fails(tmp_path):
    u = judge(tmp_path, proof_batch=0)
    assert not u.passed
    assert any("proof max_batch: 4 in the old suite, 0" in p for a in u.axes for p in a.problems)


def test_cli_upgrade_exit_codes(tmp_path):
    make_store(tmp_path / "old", "0.26.0")
    make_store(tmp_path / "clean", "0.28.0", flip="mtp-k3")
    old_t = tokens_per_iteration([counters(i, 7) for i in range(20)])
    make_store(tmp_path / "fell", "0.28.0", accept_scale={"dflash2-k7": (0.85 * old_t - 1) / (old_t - 1)})
    def run(cli, args):  # the stores hold suite "s" (no `speccheck run` wrote LATEST)
        return CliRunner().invoke(cli, args + ["--old-suite", "s", "--new-suite", "s"])
    ok = run(main, ["upgrade", str(tmp_path / "old"), str(tmp_path / "clean")])
    assert ok.exit_code == 0, ok.output
    assert "upgrade 0.26.0 (s) -> 0.28.0 (s)" in ok.output and "near_tie 1" in ok.output
    bad = run(main, ["upgrade", str(tmp_path / "old"), str(tmp_path / "fell")])
    assert bad.exit_code == 1 and "FAIL  dflash2-k7" in bad.output and "upgrade: FAIL" in bad.output
    one = run(main, ["upgrade", str(tmp_path / "old"), str(tmp_path / "fell"), "--config", "mtp-k3"])
    assert one.exit_code == 0, one.output
    assert run(main, ["upgrade", str(tmp_path / "old"), str(tmp_path / "fell"),
                      "--config", "nope-k1"]).exit_code == 2


def test_golden_is_named_by_the_engine_release(tmp_path):
    from speccheck.golden import golden_dir
    meta = {"engine": "vllm", "corpus": "smoke"}
    d = golden_dir(tmp_path, {"engine": "vllm", "model_id": "ckpt", "golden_series": "0.28.0"}, meta)
    assert d == tmp_path / "vllm" / "0.28.0" / "ckpt" / "smoke"
    assert golden_dir(tmp_path, {"engine": "reference", "model_id": "m"}, meta) == tmp_path / "reference" / "m" / "smoke"



def test_committed_vllm_goldens_are_named_by_their_release():
    """golden/vllm/<release>/...: each golden's recorded vLLM version is the folder's name."""
    import json
    from pathlib import Path

    goldens = sorted((Path(__file__).parents[1] / "golden" / "vllm").glob("*/*/*/golden.json"))
    assert goldens
    for g in goldens:
        ident = json.loads(g.read_text())["identity"]
        assert g.parents[2].name == ident["vllm_version"], g


def test_committed_goldens_are_found_where_a_run_looks_and_pass_golden_check(tmp_path):
    """Every committed golden sits where `golden check` looks for a run of its engine, model
    (the name its checkpoint declares), corpus and engine settings (recorded in golden.json),
    and today's baseline equal to it passes the check."""
    import dataclasses
    import json
    from pathlib import Path

    from speccheck.engines.vllm_versions import golden_series
    from speccheck.golden import check, golden_dir
    from speccheck.store import read_run

    root = Path(__file__).parents[1] / "golden"
    found = sorted(root.rglob("golden.json"))
    assert any("vllm" in g.parts for g in found)
    for i, g in enumerate(found):
        meta = json.loads(g.read_text())
        run = read_run(g.parent / "baseline")
        ident = dict(run.identity)
        if ident.get("vllm_version"):  # what the vLLM engine adds to its identity today
            ident["golden_series"] = golden_series(ident["vllm_version"])
        suite_meta = {"engine": meta["engine"], "corpus": meta["corpus"], "corpus_hash": run.corpus_hash,
                      "engine_args": {**meta.get("engine_settings", {}),
                                      **({"gpu_memory_utilization": "0.9"} if meta["engine"] == "vllm" else {})}}
        assert golden_dir(root, ident, suite_meta) == g.parent, g
        s = Store(tmp_path / f"st{i}").suite("s", suite_meta)
        s.write_run(dataclasses.replace(run, identity=ident))
        complete_as_run_would(s)
        chk = check(s, root, 0.0, Policy())
        assert chk.path == g.parent and chk.passed and not chk.comparison.divergences, g


def test_few_prompts_pass_only_with_identical_counters(tmp_path):
    """Below acceptance_stats' minimum of prompts the test is inconclusive, which fails; but
    counters identical prompt by prompt are unchanged without a test."""
    old = make_store(tmp_path / "old", "0.26.0")
    same = make_store(tmp_path / "same", "0.28.0")
    moved = make_store(tmp_path / "moved", "0.28.0", jitter=1)
    few = ["baseline", "mtp-k3"]
    for s in (old, same, moved):  # keep 3 prompts: rewrite r0 of mtp-k3 with its first three
        r = s.load_run("mtp-k3", 0)
        r.completions = r.completions[:3]
        s.write_run(r)
    ok = upgrade_suites(old, same, few, Policy())
    assert ok.passed and ok.configs["mtp-k3"].acceptance_identical
    bad = upgrade_suites(old, moved, few, Policy())
    assert not bad.passed and "acceptance inconclusive" in bad.configs["mtp-k3"].problems[0]
