"""Training code of the reference engine's shipped weights (speccheck/reference/weights/): the
tokenizer (tokenizer_train.py), the target with its MTP module and DFlash drafter (train.py),
the DFlash2 drafter (train_dflash2.py), their shared pieces (common.py) and text (data.py).

Not part of the installed package (nothing in ``speccheck`` imports it). Run from ``tools/``
(``python -m train_reference.train ...``) with speccheck installed; ``reproduce.sh`` re-trains
the shipped weights into a folder and compares their sha256 with weights/SHA256SUMS.
"""
