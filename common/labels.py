"""The label convention every layer shares: a target of IGNORE_INDEX is neither trained on
nor scored.

It travels in two layouts. MiniMind's `labels` are aligned with the input ids (padding set
to IGNORE_INDEX) and the model's loss shifts them; the trainer's next-token `targets` are
already shifted (targets[t] is the token after input t: dataset.lm_dataset.NextTokenTargets,
and a packed window's by construction), with IGNORE_INDEX where there is nothing to predict.
-100 is the value torch's cross-entropy and transformers ignore by default, so MiniMind's
model code reads our labels as its own.
"""
IGNORE_INDEX = -100
