"""PyTorch's learning rates for the schedules of kernels/tests/schedule_torch.rs.

Reads one run per line on stdin:

    NAME SCHEDULE PEAK MIN_LR_RATIO WARMUP TOTAL DECAY_SHAPE DECAY_STEPS

(DECAY_STEPS is the WSD decay length K, already resolved), and prints, per
run and per way of computing it, one line `NAME VARIANT LR_0 ... LR_{TOTAL-1}`
with every learning rate as Python's repr (which round-trips an f64):

* `sequential`: PyTorch's built-in schedulers, chained by SequentialLR and
  stepped once per optimizer step as a training loop would (their recursive
  `get_lr`);
* `closed`: the same schedulers' closed forms (`_get_closed_form_lr`) at
  every step;
* `lambda`: LambdaLR with the multiplier written out: for WSD, Hägele et
  al. 2024's `wsd_schedule` multiplier (epfml/schedules-and-scaling,
  src/optim/utils.py), with warmup from 0 (their init_div_factor = inf)
  and K decay steps, evaluated at step + 1.

Built-in chains (W warmup steps, D = TOTAL - W - 1, s = TOTAL - K):

* warmup: LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1), which
  is (t+1)/W and then stays at 1 (W <= 1: ConstantLR(factor=1));
* cosine: then CosineAnnealingLR(T_max=D, eta_min=floor) from milestone W;
* linear: then LinearLR(1, ratio, total_iters=D) from milestone W;
* constant: the warmup alone;
* wsd, linear and cosine shapes: LinearLR(1, ratio, total_iters=K) or
  CosineAnnealingLR(T_max=K, eta_min=floor) from milestone s - 1 (their
  epoch 0, the peak, falls on the last stable step), after a
  ConstantLR(factor=1) hold from W; the 1-sqrt shape has no built-in.
"""

import math
import sys
import warnings

import torch
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    SequentialLR,
)

# SequentialLR passes an epoch to step() at milestones (deprecated).
warnings.simplefilter("ignore")


class Holder(torch.optim.Optimizer):
    """One parameter group at learning rate `lr` and no parameters, all a
    scheduler reads and writes. Optimizer.__init__ is skipped: it imports
    torch._dynamo, which takes seconds. (With torch.optim.SGD over one
    parameter instead, every learning rate printed is the same.)"""

    def __init__(self, lr):
        self.defaults = {"lr": lr}
        self.param_groups = [{"lr": lr, "params": []}]
        self.state = {}

    def step(self, closure=None):
        pass


def optimizer(peak):
    return Holder(peak)


def shape_factor(shape, q):
    if shape == "linear":
        return 1.0 - q
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * q))
    if shape == "sqrt":
        return 1.0 - math.sqrt(q)
    raise ValueError(shape)


def hagele_wsd(n_iterations, final, n_warmup, n_anneal, shape):
    """The WSD multiplier of Hägele et al. 2024, warmup from 0."""
    n_hold = n_iterations - n_anneal

    def f(step):
        if step < n_warmup:
            return step / n_warmup
        if step < n_hold:
            return 1.0
        if step < n_iterations:
            return final + (1.0 - final) * shape_factor(shape, (step - n_hold) / n_anneal)
        return final

    return f


def multiplier(run):
    """The schedule as a LambdaLR multiplier of step t."""
    kind, ratio, w, total, shape, k = (
        run["schedule"], run["ratio"], run["warmup"], run["total"], run["shape"], run["k"])
    if kind == "wsd":
        f = hagele_wsd(total, ratio, w, k, shape)
        return lambda t: f(t + 1)
    d = total - w - 1

    def g(t):
        if t < w:
            return (t + 1) / w
        if kind == "constant":
            return 1.0
        q = min((t - w) / d, 1.0)
        return ratio + (1.0 - ratio) * shape_factor(kind, q)

    return g


def phases(opt, run):
    """[(first step, scheduler)] of the built-in chain, or None."""
    kind, peak, ratio, w, total, shape, k = (
        run["schedule"], run["peak"], run["ratio"], run["warmup"], run["total"],
        run["shape"], run["k"])
    floor = peak * ratio

    def warmup():
        if w >= 2:
            return LinearLR(opt, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1)
        return ConstantLR(opt, factor=1.0, total_iters=0)

    if kind == "constant":
        return [(0, warmup())]
    if kind in ("cosine", "linear"):
        d = total - w - 1
        out = [(0, warmup())] if w > 0 else []
        if kind == "cosine":
            out.append((w, CosineAnnealingLR(opt, T_max=d, eta_min=floor)))
        else:
            out.append((w, LinearLR(opt, start_factor=1.0, end_factor=ratio, total_iters=d)))
        return out
    if shape == "sqrt":
        return None
    start = total - k - 1  # the decay scheduler's epoch 0 (the peak): s - 1
    if start < 0:
        return None
    hold = lambda: ConstantLR(opt, factor=1.0, total_iters=0)  # noqa: E731
    out = []
    if start > 0:
        out.append((0, warmup() if w > 0 else hold()))
        if start > w > 0:
            out.append((w, hold()))
    if shape == "cosine":
        out.append((start, CosineAnnealingLR(opt, T_max=k, eta_min=floor)))
    else:
        out.append((start, LinearLR(opt, start_factor=1.0, end_factor=ratio, total_iters=k)))
    return out


def stepped(opt, sched, total):
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        name, kind, peak, ratio, w, total, shape, k = line.split()
        run = dict(schedule=kind, peak=float(peak), ratio=float(ratio), warmup=int(w),
                   total=int(total), shape=shape, k=int(k))
        total = run["total"]
        results = {}

        opt = optimizer(run["peak"])
        results["lambda"] = stepped(opt, LambdaLR(opt, multiplier(run)), total)

        opt = optimizer(run["peak"])
        ph = phases(opt, run)
        if ph is not None:
            if len(ph) == 1:
                chain = ph[0][1]
            else:
                chain = SequentialLR(opt, [s for _, s in ph], milestones=[m for m, _ in ph[1:]])
            results["sequential"] = stepped(opt, chain, total)

            opt = optimizer(run["peak"])
            ph = phases(opt, run)
            closed = []
            for t in range(total):
                first, sched = [p for p in ph if p[0] <= t][-1]
                sched.last_epoch = t - first
                closed.append(sched._get_closed_form_lr()[0])
            results["closed"] = closed

        for variant, lrs in results.items():
            print(name, variant, " ".join(map(repr, lrs)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
