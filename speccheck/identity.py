"""What differs between two runs' identities (engine, version, weights, GPUs, TP size, kernel
knobs), and which of those differences follow from another (GPUs and links follow TP/PP)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: identity keys a comparison of two suites names when they differ (key, label, value when a
#: suite's identity lacks the key: a run without TP ran on one GPU)
IDENTITY_FIELDS = (
    ("engine", "engine", None), ("version", "engine version", None),
    ("model_hash", "model weights", None), ("draft_hash", "draft weights", None),
    ("tokenizer_hash", "tokenizer", None), ("dtype", "dtype", None),
    ("device", "GPU model", None), ("gpu_driver", "GPU driver", None),
    ("torch", "torch version", None), ("cuda", "CUDA version", None),
    ("tensor_parallel_size", "TP size", 1), ("pipeline_parallel_size", "PP size", 1),
    ("gpus_used", "GPUs used", 1), ("interconnect", "interconnect", None),
    ("distributed_executor_backend", "executor", None), ("all_reduce", "all-reduce", None),
    ("nccl_version", "NCCL version", None),
    ("attention_backend", "attention backend", None),
    ("draft_attention_backend", "drafter attention backend", None),
    ("gdn_prefill_backend", "GDN prefill backend", None),
    ("gdn_decode_kernel", "GDN decode kernel", None), ("gdn_verify_kernel", "GDN verify kernel", None),
    ("cudagraph_mode", "CUDA graphs", None), ("knobs", "kernel knobs", None),
)
#: fields that follow from the TP and PP sizes (vLLM runs one GPU without an executor process
#: or all-reduce, and TP x PP GPUs over their links otherwise): named, not blamed, when the
#: sizes themselves differ
FOLLOW_PARALLEL = {"gpus_used", "interconnect", "distributed_executor_backend", "all_reduce"}
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


@dataclass
class IdentityChange:
    key: str
    label: str
    a: object
    b: object
    follows: bool = False  # a consequence of another change (GPUs and links follow TP/PP)

    def __str__(self) -> str:
        return f"{self.label} {_show(self.a)} → {_show(self.b)}"


def _show(v) -> str:
    """An identity value, short: a sha256 by its first 12 digits, nothing as a dash."""
    return "—" if v is None else (v[:12] if isinstance(v, str) and len(v) == 64 else str(v))


def identity_changes(a: dict, b: dict) -> list[IdentityChange]:
    """The IDENTITY_FIELDS in which two runs' identities differ, those that follow from a TP/PP
    change marked ``follows``."""
    out = []
    for key, label, default in IDENTITY_FIELDS:
        va, vb = a.get(key, default), b.get(key, default)
        if key == "dtype":
            va, vb = (_DTYPES.get(str(v).lower(), str(v).lower()) if v is not None else None for v in (va, vb))
        if isinstance(va, dict) and isinstance(vb, dict):  # name the entries that differ
            out += [IdentityChange(f"{key}.{k}", f"{label[:-1]} {k}", va.get(k), vb.get(k))
                    for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)]
        elif va != vb:
            out.append(IdentityChange(key, label, va, vb))
    sizes = any(c.key in ("tensor_parallel_size", "pipeline_parallel_size") for c in out)
    for c in out:
        c.follows = sizes and c.key in FOLLOW_PARALLEL
    return out


def changes_cause(changes: Sequence[IdentityChange]) -> str:
    """What a difference between the suites is blamed on: the changed fields' labels."""
    primary = [c.label for c in changes if not c.follows]
    if not primary:
        return "nothing recorded in the identity"
    return ", ".join(primary[:4]) + (f" and {len(primary) - 4} more" if len(primary) > 4 else "")


def changes_str(changes: Sequence[IdentityChange]) -> str:
    if not changes:
        return "identical identities (the same engine, model, GPUs and layout)"
    primary = [str(c) for c in changes if not c.follows]
    follows = [str(c) for c in changes if c.follows]
    return "; ".join(primary) + (f" (with it: {'; '.join(follows)})" if follows else "")


_SHORT = {"tensor_parallel_size": "TP", "pipeline_parallel_size": "PP"}


def side_names(changes: Sequence[IdentityChange]) -> tuple[str, str]:
    """Names for the two sides from their first changed field ("TP=1", "TP=2"), else A and B."""
    for c in changes:
        if not c.follows and not (isinstance(c.a, (dict, list)) or isinstance(c.b, (dict, list))):
            short = _SHORT.get(c.key, c.label)
            return f"{short}={_show(c.a)}", f"{short}={_show(c.b)}"
    return ("A", "B")

