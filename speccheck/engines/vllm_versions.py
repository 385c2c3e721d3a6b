"""What the ``vllm`` engine relies on in each vLLM release: ONE table keyed by version.

Each entry holds from its release until the next entry; a version reads the newest entry not
after it (``release_entry``). Every name below was read from vLLM's own source of the release
that opens the entry (and checked against the later ones): ``scripts/record_vllm_facts.py``
records those facts from a vLLM tree (no import, no GPU) into ``tests/fixtures/vllm/versions/``,
and the tests hold this table against the recorded facts of 0.26.0, 0.27.1, 0.28.0 and 0.33.0.
The one place to change when vLLM renames a metric, a config key, an environment switch or a
model-runner attribute. Pure: imported by the parent and by the worker (no vLLM import).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from speccheck.version import release

#: the metric names of vLLM 0.26 (as ``LLM.get_metrics()`` gives them; a counter may also carry
#: Prometheus' ``_total``); unchanged through 0.33 (every recorded release has them all)
_METRICS_0_26 = MappingProxyType({
    # speculative decoding: counters, and a vector per draft position
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
    # serving (the workload axes' proof): a gauge of the scheduler's running requests, set at
    # every engine step; counters of prompt tokens looked up in and found in the prefix cache;
    # a counter of preemptions (a request evicted and later recomputed)
    "requests_running": "vllm:num_requests_running",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "preemptions": "vllm:num_preemptions",
})


@dataclass(frozen=True)
class VllmRelease:
    """The knobs of one range of vLLM releases (from ``since`` until the next entry)."""

    since: tuple[int, ...]
    #: speccheck's name -> vLLM's metric name
    metrics: Mapping[str, str]
    #: speculative_config methods speccheck's methods map to (dflash2 -> dflash + its draft)
    spec_methods: frozenset[str]
    #: speculative_config keys the adapter writes (``SpeculativeConfig`` fields)
    spec_keys: frozenset[str]
    #: DFlash2 drafts (``DFlash2DraftModel`` -> ``DFlash2Qwen3ForCausalLM``) exist
    dflash2: bool
    #: the environment switch of the V2 model runner, and its runner / the V1 one (module.class)
    v2_runner_env: str = "VLLM_USE_V2_MODEL_RUNNER"
    runner_v2: str = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    runner_v1: str = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
    #: where a model runner holds its drafter: V2 ``speculator``, V1 ``drafter``
    drafter_attrs: tuple[str, ...] = ("speculator", "drafter")
    #: the V2 DFlash speculator's block (anchor + K slots) and K, and DFlash2's selector top-k
    block_attr: str = "num_query_per_req"
    steps_attr: str = "num_speculative_steps"
    selector_top_k_attr: str | None = None
    #: the speculator class that runs the candidate selector (its _generate_draft calls it)
    dflash2_speculator: str | None = None
    dflash2_draft_class: str | None = None
    #: GDN kernel switches (attribution): packed recurrent decode; the spec-verify kernel
    packed_decode_env: str = "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE"
    gdn_decode_kernel_env: str | None = None
    gdn_prefill_backends: tuple[str, ...] = ("flashinfer", "triton", "cutedsl")
    #: attention backends of a Qwen3.5 target's full-attention layers on CUDA (FLASHINFER only
    #: where flashinfer is installed)
    attention_backends: tuple[str, ...] = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
    #: ``Logprob`` fields the worker reads, and ``RequestStateStats`` fields (timings)
    logprob_fields: tuple[str, ...] = ("logprob", "rank", "decoded_token")
    request_stats: tuple[str, ...] = ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts",
                                      "last_token_ts", "first_token_latency", "num_generation_tokens")
    #: ``LLM(async_scheduling=...)`` exists (SchedulerConfig.async_scheduling)
    async_scheduling: bool = True
    #: what the workload axes read of each engine step (``EngineCoreOutputs``, as
    #: ``LLMEngine.step`` takes them from ``engine_core.get_output()``): the scheduler stats'
    #: running requests; the CUDA-graph stat of the step (``LLM(cudagraph_metrics=True)``:
    #: tokens before and after padding, the graph mode); a request's PREEMPTED events
    step_running_field: str = "num_running_reqs"
    cudagraph_metrics_arg: str = "cudagraph_metrics"
    cudagraph_stat_fields: tuple[str, ...] = ("num_unpadded_tokens", "num_padded_tokens", "runtime_mode")
    preempted_event: str = "PREEMPTED"
    #: ``RequestStateStats`` (``RequestOutput.metrics``) counts its request's preemptions
    request_preemptions_field: str | None = None
    #: the ``LLM(...)`` argument that gives each request its own spec-decode counters
    #: (``CompletionOutput.spec_decode_metrics``: a histogram of accepted drafts per verify
    #: step), and the level asked for; None where vLLM has only the engine-wide counters
    per_request_spec_metrics_arg: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return ".".join(map(str, self.since))


_SPEC_KEYS = frozenset({"method", "model", "num_speculative_tokens", "attention_backend"})

#: the table. 0.27.x reads the 0.26 entry (its recorded facts match it: no DFlash2 yet).
VLLM_RELEASES: dict[tuple[int, ...], VllmRelease] = {
    (0, 26): VllmRelease(since=(0, 26), metrics=_METRICS_0_26, spec_methods=frozenset({"mtp", "dflash"}),
                         spec_keys=_SPEC_KEYS, dflash2=False),
    # PR #52816: qwen3_dflash2.py + v1/worker/gpu/spec_decode/dflash2 (DFlash2Speculator,
    # selector top-k in ``selector_top_k``); config/vllm.py forces the V2 runner for a DFlash2
    # draft unless VLLM_USE_V2_MODEL_RUNNER says otherwise (then it drafts as DFlash, silently);
    # VLLM_GDN_DECODE_KERNEL=cuda|triton picks the GDN kernel of spec-verify steps
    (0, 28): VllmRelease(since=(0, 28), metrics=_METRICS_0_26, spec_methods=frozenset({"mtp", "dflash"}),
                         spec_keys=_SPEC_KEYS, dflash2=True, selector_top_k_attr="selector_top_k",
                         dflash2_speculator="DFlash2Speculator",
                         dflash2_draft_class="DFlash2Qwen3ForCausalLM",
                         gdn_decode_kernel_env="VLLM_GDN_DECODE_KERNEL"),
    # the selector's top-k moved to ``DFlash2Speculator.top_k`` (CandidateSampler); the GDN
    # prefill backends grew aiter_flydsl and sycl (not CUDA paths); RequestStateStats counts a
    # request's preemptions; per_request_spec_decode_metrics gives each request its counters
    (0, 33): VllmRelease(since=(0, 33), metrics=_METRICS_0_26, spec_methods=frozenset({"mtp", "dflash"}),
                         spec_keys=_SPEC_KEYS, dflash2=True, selector_top_k_attr="top_k",
                         dflash2_speculator="DFlash2Speculator",
                         dflash2_draft_class="DFlash2Qwen3ForCausalLM",
                         gdn_decode_kernel_env="VLLM_GDN_DECODE_KERNEL",
                         gdn_prefill_backends=("flashinfer", "triton", "cutedsl", "aiter_flydsl", "sycl"),
                         request_preemptions_field="num_preemptions",
                         per_request_spec_metrics_arg="per_request_spec_decode_metrics"),
}
#: the oldest release the adapter supports (older: refused, see version_problem)
MIN_VLLM = min(VLLM_RELEASES)
#: the first release with DFlash2
DFLASH2_MIN_VLLM = min(k for k, r in VLLM_RELEASES.items() if r.dflash2)
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def release_entry(version: str | None = None) -> VllmRelease:
    """The table's entry for ``version`` (None: the newest; older than every entry: the oldest)."""
    keys = sorted(VLLM_RELEASES)
    if version:
        older = [k for k in keys if k <= release(version)]
        return VLLM_RELEASES[older[-1] if older else keys[0]]
    return VLLM_RELEASES[keys[-1]]


def version_problem(version: str | None) -> str | None:
    """Why the adapter refuses this vLLM (older than MIN_VLLM), or None (unknown: the worker's)."""
    if version and release(version) < MIN_VLLM:
        return (f"vLLM {version} is older than the oldest release speccheck's vLLM engine supports "
                f"({'.'.join(map(str, MIN_VLLM))}): its metric names, speculative-config keys and "
                f"model-runner attributes are not in the version table. Install vLLM ≥ "
                f"{'.'.join(map(str, MIN_VLLM))}.")
    return None


def golden_series(version: str | None) -> str | None:
    """The name goldens of this vLLM live under (``golden/vllm/<series>/...``): its release."""
    rel = release(version) if version else ()
    return ".".join(map(str, rel)) if rel else None
