"""Wording several checks share: how a divergence is quoted, percentages, and the notes on
thresholds that could not be calibrated."""
from __future__ import annotations

from speccheck.verify import Divergence, DriftTest, PairedDriftTest


def fmt_div(d: Divergence) -> str:
    c = d.classification
    ctx = f" context {d.context!r}" if d.context else ""
    return (f"prompt {d.prompt_id} position {d.position}: baseline token {d.base_token} vs {d.spec_token}, "
            f"baseline margin {c.base_margin:.3f} nats ({d.margin_in_noise:.1f}x path noise), "
            f"spec margin {c.spec_margin:.3f}, rank of spec token in baseline top-k "
            f"{'absent' if c.spec_rank_in_base is None else c.spec_rank_in_base + 1} -> {c.cls}{ctx}")



NOTHING_COMPARED = "evidence missing: no prompt was compared with a baseline output"


def untrusted_tau(n: int, why: str) -> str:
    return (f"{n} divergence(s) would be excused as near-tie/low-confidence, but the thresholds "
            f"were not calibrated -- path noise unmeasured ({why}); they came from the policy "
            "floors, so nothing is excused")



NOT_INVARIANT = "this engine is not batch-invariant at ties, with or without speculation"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"



def drift_str(t: DriftTest, against: str) -> str:
    s, ref = t.spec, t.reference
    return (f"|Δ| median {s.median:.4f} / p90 {s.p90:.4f} / max {s.max:.4f} nats over {s.n} positions vs "
            f"{against} {ref.median:.4f} / {ref.p90:.4f} / {ref.max:.4f} ({ref.n}): ratio {t.ratio:.2f} "
            f"(max {t.max_ratio:.2f}), KS D+ {t.ks:.3f}, rank-test p {t.p:.2g}")


def paired_str(t: PairedDriftTest) -> str:
    return (f"|Δ| median {t.spec.median:.4f} nats vs the baseline decode path's {t.reference.median:.4f} "
            f"over {t.n} shared positions: ratio {t.ratio:.2f} (max {t.max_ratio:.2f}), "
            f"signed-rank p {t.p:.2g}")

