"""Train the reference engine's byte-level BPE tokenizer and write weights/tokenizer.json.

    cd tools && python -m train_reference.tokenizer_train [--out PATH] [--vocab-size 4096]

Deterministic for a given Python version (the training text is the stdlib, see data.py). The
pre-tokenizer is Qwen2's split regex (digits one by one, letters runs, punctuation runs) followed
by byte-level mapping, so the tokenizer behaves like the family's. The built-in corpora's prompts
that contain non-ASCII text (the Japanese ones) are repeated ``--non-ascii-weight`` times in the
training stream: they are a tiny fraction of the text, and without the boost Japanese would be
left at about 3 raw bytes per character (an OCR prompt ~7k tokens instead of ~3k).
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

import speccheck.reference

from .data import MAX_TOTAL_BYTES, corpus_texts, stdlib_texts

#: fixed ids the engine relies on: 0 end of text (also padding), 1 the DFlash mask slot,
#: 2-4 the chat role markers of ``Prompt.as_text``
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEFAULT_OUT = Path(speccheck.reference.__file__).resolve().parent / "weights" / "tokenizer.json"


def build_tokenizer(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--non-ascii-weight", type=int, default=20)
    ap.add_argument("--max-bytes", type=int, default=MAX_TOTAL_BYTES,
                    help="stdlib text cap (the shipped tokenizer: the default)")
    args = ap.parse_args(argv)
    code = stdlib_texts(args.max_bytes)
    prompts = corpus_texts()
    boosted = [t for t in prompts if not t.isascii()] * (args.non_ascii_weight - 1)
    tok = build_tokenizer(code + prompts + boosted, args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # canonical, compact JSON so the file (and its hash) only changes when the tokenizer does
    data = json.loads(tok.to_str())
    args.out.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n",
                        encoding="utf-8")
    n_code = sum(len(tok.encode(t).ids) for t in code[:200])
    b_code = sum(len(t.encode()) for t in code[:200])
    print(f"trained on {len(code)} stdlib files + {len(prompts)} corpus prompts "
          f"(non-ASCII ones x{args.non_ascii_weight})")
    print(f"vocab {tok.get_vocab_size()}; stdlib sample {b_code / n_code:.2f} bytes/token")
    print(f"wrote {args.out} sha256 {hashlib.sha256(args.out.read_bytes()).hexdigest()}")


if __name__ == "__main__":
    main()
