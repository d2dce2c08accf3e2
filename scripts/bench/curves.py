"""Validation curves as bench_quality.py reads them: lists of rows {step, train_s, val_loss,
val_bpb} in training order, one per validation (the trainer's metrics rows of kind "val", or the
OOD rows of held_out_ood.py's ood_curve, which share the keys); and the figures over seeds."""


def first_reach(val: list[dict], target: float, key: str) -> float | None:
    """`key` (train_s or step) where the val curve first falls to `target`, linearly
    interpolated between the two validations around the crossing."""
    for prev, row in zip([None] + val, val):
        if row["val_loss"] <= target:
            if prev is None:
                return row[key]
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - row["val_loss"])
            return prev[key] + frac * (row[key] - prev[key])
    return None


def at_time(val: list[dict], seconds: float, key: str) -> float:
    """`key` linearly interpolated at `seconds` (the last value past the end of the run)."""
    points = [(0.0, None)] + [(r["train_s"], r[key]) for r in val]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if seconds <= t1:
            return v1 if v0 is None else v0 + (v1 - v0) * (seconds - t0) / (t1 - t0)
    return points[-1][1]


def spread(values: list, spec: str) -> str:
    """'mean (min-max)' of the values there are (None: a seed that never got there), in format
    `spec`, and how many there are when not all."""
    have = [v for v in values if v is not None]
    if not have:
        return "-"
    text = f"{sum(have) / len(have):{spec}} ({min(have):{spec}}-{max(have):{spec}})"
    return text if len(have) == len(values) else f"{text}, {len(have)} of {len(values)}"


def mean(values: list):
    """The mean of the values there are (None: a seed without final weights), or None."""
    have = [v for v in values if v is not None]
    return sum(have) / len(have) if have else None
