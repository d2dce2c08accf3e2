"""The Newton-Schulz iteration Muon orthogonalises its updates with (trainer/muon.py), and
its coefficients.

Each iteration applies an odd quintic p(s) = a s + b s^3 + c s^5 to every singular value s
of X (X <- aX + (bA + cA^2)X, A = XX^T), after X was scaled to Frobenius norm 1 so that
every s lies in (0, 1]. Two schedules of coefficients:

    quintic        Keller Jordan's (a, b, c), the same each iteration (torch.optim.Muon's
                   default): fast to leave 0, but it leaves the singular values anywhere in
                   about [0.7, 1.2] instead of at 1
    polar_express  Polar Express (Amsel, Persson, Musco, Gower, 2025): one (a, b, c) per
                   iteration, each the best polynomial for the interval the previous ones
                   leave, so five iterations end closer to the orthogonal factor U V^T (the
                   singular values in about [0.86, 1.14]; tests/test_muon.py measures it).
                   Its coefficients assume every singular value is at most 1; the input is
                   scaled by a further 1/1.01, the safety factor, so that rounding (bf16's
                   above all) cannot push one past it

Both run five iterations of the same three matmuls, so they cost the same FLOPs.
"""
import torch

# Keller Jordan's quintic (torch.optim.Muon's ns_coefficients), run NS_STEPS times.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7

# Polar Express for five iterations, as published (computed with safety factor 2e-2, cushion 2).
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.01

NS_METHODS = ("quintic", "polar_express")


def iteration_plan(method: str, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS) -> tuple[tuple, float]:
    """(one (a, b, c) per iteration, the safety factor) of `method`. The quintic repeats
    `coefficients` `steps` times (torch.optim.Muon's ns_coefficients and ns_steps)."""
    if method == "quintic":
        return (tuple(coefficients),) * steps, 1.0
    if method == "polar_express":
        return POLAR_EXPRESS_COEFFICIENTS, POLAR_EXPRESS_SAFETY
    raise ValueError(f"Newton-Schulz method {method!r}: one of {NS_METHODS}")


def newton_schulz(x, plan=(NS_COEFFICIENTS,) * NS_STEPS, safety: float = 1.0, eps: float = EPS):
    """Orthogonalise each matrix of a (k, m, n) stack with m <= n: scaled to Frobenius norm
    1 / safety, then one iteration X <- aX + (bA + cA^2)X, A = XX^T, per (a, b, c) of `plan`."""
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * safety).clamp(min=eps)
    for a, b, c in plan:
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def newton_schulz_flops(shapes, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of one orthogonalisation of matrices of these shapes, as newton_schulz runs
    them (wide, m <= n): per step X X^T (2m^2n), A A (2m^3) and B X (2m^2n). Both methods run
    NS_STEPS (5) steps."""
    return sum(steps * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)

