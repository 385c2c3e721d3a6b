"""Matrix syntax and the policy's sources and errors."""
from pathlib import Path

import pytest

from speccheck.config import DEFAULT_MATRIX, MatrixError, build_matrix, parse_k
from speccheck.policy import Policy, PolicyError, load_policy


@pytest.mark.parametrize("spec,want", [("7", [7]), ("1-3", [1, 2, 3]), ("1,3,7", [1, 3, 7]),
                                       ("1-2,5", [1, 2, 5]), ("3,1,3", [1, 3])])
def test_parse_k(spec, want):
    assert parse_k(spec) == want


@pytest.mark.parametrize("spec", ["0", "33", "3-1", "a", "1-", ""])
def test_parse_k_rejects(spec):
    with pytest.raises(MatrixError, match="--k"):
        parse_k(spec)


def test_default_matrix_and_baseline_first():
    assert [c.name for c in build_matrix()] == list(DEFAULT_MATRIX)
    names = [c.name for c in build_matrix(["dflash", "mtp"], "2,4")]
    assert names == ["baseline", "dflash-k2", "dflash-k4", "mtp-k2", "mtp-k4"]


def test_unknown_method_names_the_option_and_choices():
    with pytest.raises(MatrixError, match=r"--method 'eagle'.*baseline, mtp, dflash"):
        build_matrix(["eagle"])
    assert [c.name for c in build_matrix(["eagle"], "3", offered=None)] == ["baseline", "eagle-k3"]


def test_dflash_default_k_from_engine():
    assert [c.name for c in build_matrix(["dflash"], default_k={"dflash": 7})] == ["baseline", "dflash-k7"]


def test_policy_sources_in_order(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.speccheck]\nmin_token_agreement = 0.9\nmax_high_confidence = 2\n")
    (tmp_path / "speccheck.toml").write_text("max_high_confidence = 3\n")
    extra = tmp_path / "p.toml"
    extra.write_text("[policy]\nmin_speedup = 1.5\n")
    p = load_policy(str(extra), {"tie_floor": "0.05"}, cwd=tmp_path)
    assert (p.min_token_agreement, p.max_high_confidence, p.min_speedup, p.tie_floor) == (0.9, 3, 1.5, 0.05)
    assert load_policy(cwd=tmp_path / "nowhere") == Policy()


def test_policy_errors_name_the_source(tmp_path):
    (tmp_path / "speccheck.toml").write_text("min_token_agreemnt = 0.9\n")
    with pytest.raises(PolicyError, match="speccheck.toml: unknown policy key 'min_token_agreemnt'"):
        load_policy(cwd=tmp_path)
    with pytest.raises(PolicyError, match="wants a number > 0 or false"):
        load_policy(overrides={"min_speedup": "fast"}, cwd=tmp_path / "x")
    (tmp_path / "speccheck.toml").write_text("min_token_agreement = [\n")
    with pytest.raises(PolicyError, match="cannot read policy TOML"):
        load_policy(cwd=tmp_path)


@pytest.mark.parametrize("key", ["min_speedup", "min_prefix_agreement", "min_text_similarity"])
def test_a_report_only_floor_is_off_by_a_word_never_by_a_zero(key, tmp_path):
    """Off is ``false``/``off``; a zero is refused (it would be met by every config), a number
    above it is a floor; the default stays off, so the default verdicts do not move."""
    assert getattr(Policy(), key) is False
    for off in ("off", "false", False):
        assert getattr(load_policy(overrides={key: off}, cwd=tmp_path), key) is False
    with pytest.raises(PolicyError, match=f"{key} = false"):
        load_policy(overrides={key: "0"}, cwd=tmp_path)
    with pytest.raises(PolicyError, match="is a threshold"):
        load_policy(overrides={key: "true"}, cwd=tmp_path)
    assert getattr(load_policy(overrides={key: "0.5"}, cwd=tmp_path), key) == 0.5
    (tmp_path / "pyproject.toml").write_text(f"[tool.speccheck]\n{key} = 0\n")
    with pytest.raises(PolicyError, match="pyproject.toml"):
        load_policy(cwd=tmp_path)


@pytest.mark.parametrize("key", ["min_token_agreement", "max_logprob_drift", "topk_drift_max_ratio",
                                 "topk_tail_max_odds"])
def test_a_vacuous_zero_is_refused(key, tmp_path):
    """A floor of 0 passes everything and a ratio limit of 0 fails everything: both refused,
    with the key named (these used to reach the statistics and crash, or check nothing)."""
    with pytest.raises(PolicyError, match=f"'{key}' must be"):
        load_policy(overrides={key: "0"}, cwd=tmp_path)


def test_look_closer_below_its_alpha_is_refused(tmp_path):
    """A look-closer threshold below its alpha leaves no inconclusive band without saying so."""
    from speccheck.policy import LOOK_CLOSER

    for alpha, look in LOOK_CLOSER:
        with pytest.raises(PolicyError, match=f"{look} .* is below {alpha}"):
            load_policy(overrides={look: "0"}, cwd=tmp_path)
        equal = load_policy(overrides={look: str(getattr(Policy(), alpha))}, cwd=tmp_path)
        assert getattr(equal, look) == getattr(Policy(), alpha)


def test_a_floor_on_a_figure_that_was_not_measured_fails():
    """min_speedup / min_text_similarity set while the suite has no such figure: not judged,
    so not passed."""
    from types import SimpleNamespace

    from speccheck.checks import get

    r = SimpleNamespace(speed=SimpleNamespace(speedup=None), token_agreement=1.0, token_agreement_n=40,
                        prefix_agreement=1.0, text_similarity=None, prompts=4, prompts_exact=4)
    p = load_policy(overrides={"min_speedup": "1.0", "min_text_similarity": "0.9"}, cwd=Path("/nonexistent"))
    assert not get("speedup").judge(r, p).passed
    c = get("agrees_with_baseline").judge(r, p)
    assert not c.passed and "text similarity not measured" in c.message
    assert get("speedup").judge(r, Policy()).skipped
