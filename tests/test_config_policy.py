"""Matrix syntax and the policy's sources and errors."""
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
    with pytest.raises(PolicyError, match="wants a float"):
        load_policy(overrides={"min_speedup": "fast"}, cwd=tmp_path / "x")
    (tmp_path / "speccheck.toml").write_text("min_token_agreement = [\n")
    with pytest.raises(PolicyError, match="cannot read policy TOML"):
        load_policy(cwd=tmp_path)
