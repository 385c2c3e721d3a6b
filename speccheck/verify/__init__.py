"""What "agree" means: pure functions over token/logprob arrays (no engine imports, no I/O).

See docs/design.md (what "agree" means).
"""
from speccheck.verify.acceptance import (Acceptance, SameOutputAcceptance, acceptance_mismatches,
                                         acceptance_of, acceptance_summary, counter_problems,
                                         output_digest, same_output_acceptance, tokens_per_iteration_views)
from speccheck.verify.boundaries import Boundary, boundary_divergence, stop_tokens
from speccheck.verify.divergence import (END, Divergence, below_floor_p, detectable_agreement,
                                         find_divergences,
                                         teacher_forced_agreement, teacher_forced_divergences)
from speccheck.verify.logprobs import (DeltaSummary, DriftTest, FlipBudget, PairedDriftTest,
                                       abs_deltas, drift_test, flip_budget, hodges_lehmann,
                                       ks_greater, paired_deltas, paired_drift_test, rank_test_greater,
                                       typical_ratio, signed_rank_test_greater, summarize)
from speccheck.verify.margins import (CLASSES, SEVERITY, Classification, calibrate_thresholds,
                                      classify_divergence, margins, path_noise, rank_of)
from speccheck.verify.speedup import RepeatTiming, SpeedupModel, speedup_model
from speccheck.verify.ties import canonical_rows, canonical_topk
from speccheck.verify.streams import (DeterminismResult, PrefixAgreement, determinism,
                                      first_divergence, prefix_agreement, text_similarity,
                                      unique_completions)
from speccheck.verify.acceptance_stats import (AcceptanceComparison, AcceptanceInterval,
                                               CountMismatch, DetectableDrop, Difference, Estimate,
                                               PromptCounts, acceptance_interval, compare_acceptance,
                                               exact_acceptance_mismatch, holm,
                                               minimum_detectable_drop, prompt_counts)
from speccheck.verify.argmax import (ARGMAX_TOL, ArgmaxCheck, ArgmaxSummary, ArgmaxViolation,
                                     Rank2Test, argmax_summary, argmax_violations,
                                     near_tie_rank2_test)
from speccheck.verify.topk_drift import (FAIL, INCONCLUSIVE, PASS, TailTest, TopkDrift, decide,
                                         detectable_odds, detectable_ratio, shared_context,
                                         tail_exceedance_test, topk_abs_deltas, topk_drift_test)
from speccheck.verify.finite import LogprobProblem, find_logprob_problems, logprob_problems

__all__ = [
    "Acceptance", "acceptance_mismatches", "acceptance_of", "acceptance_summary",
    "counter_problems", "tokens_per_iteration_views", "SameOutputAcceptance", "output_digest",
    "same_output_acceptance",
    "Boundary", "boundary_divergence", "stop_tokens",
    "END", "Divergence", "below_floor_p", "detectable_agreement", "find_divergences", "teacher_forced_agreement", "teacher_forced_divergences",
    "DeltaSummary", "DriftTest", "FlipBudget", "abs_deltas", "drift_test", "flip_budget",
    "ks_greater", "rank_test_greater", "summarize", "PairedDriftTest", "paired_deltas",
    "paired_drift_test", "signed_rank_test_greater", "hodges_lehmann", "typical_ratio",
    "CLASSES", "SEVERITY", "Classification", "calibrate_thresholds", "classify_divergence",
    "margins", "path_noise", "rank_of",
    "RepeatTiming", "SpeedupModel", "speedup_model",
    "canonical_rows", "canonical_topk",
    "DeterminismResult", "PrefixAgreement", "determinism", "first_divergence",
    "prefix_agreement", "text_similarity", "unique_completions",
    "AcceptanceComparison", "AcceptanceInterval", "CountMismatch", "DetectableDrop", "Difference",
    "Estimate", "PromptCounts", "acceptance_interval", "compare_acceptance",
    "exact_acceptance_mismatch", "holm", "minimum_detectable_drop", "prompt_counts",
    "ARGMAX_TOL", "ArgmaxCheck", "ArgmaxSummary", "ArgmaxViolation", "Rank2Test",
    "argmax_summary", "argmax_violations", "near_tie_rank2_test",
    "LogprobProblem", "find_logprob_problems", "logprob_problems",
    "FAIL", "INCONCLUSIVE", "PASS", "TailTest", "TopkDrift", "decide", "detectable_odds",
    "detectable_ratio", "shared_context", "tail_exceedance_test", "topk_abs_deltas", "topk_drift_test",
]
