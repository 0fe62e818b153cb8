//! The simulator: per-action costs in, timeline, bubble and memory out.

use crate::error::{Error, Result};
use crate::schedule::{Action, ActionKind, Schedule};
use crate::validate::{check_structure, deadlock};

/// Time and memory of one model chunk (virtual stage) for one micro-batch.
///
/// Times are in any unit (seconds, or multiples of a forward); memory in
/// any unit (bytes, or multiples of one stage's activations `M_B`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkCost {
    /// Forward time `F`.
    pub forward: f64,
    /// Input-gradient backward time `B`.
    pub backward_input: f64,
    /// Weight-gradient backward time `W`. A whole backward `BW` takes
    /// `B + W`.
    pub backward_weight: f64,
    /// Activation memory a forward allocates (`M_B` in Qi et al.).
    pub activation: f64,
    /// Memory still held after `B` until `W` frees it (`M_W` in Qi et al.).
    pub weight_grad_memory: f64,
}

/// Costs of every virtual stage plus the point-to-point latency.
#[derive(Debug, Clone, PartialEq)]
pub struct Costs {
    /// One entry per virtual stage, in forward order.
    pub chunks: Vec<ChunkCost>,
    /// Time from the end of an action to the moment its output can be used
    /// on another stage (same stage: no delay).
    pub p2p_latency: f64,
}

impl Costs {
    /// Uniform costs given **per full stage** (all `v` chunks of a stage
    /// together take `forward`, `backward_input`, `backward_weight`, and
    /// hold activation 1 = `M_B`), split evenly over the chunks. `M_W` is
    /// taken equal to `M_B` (conservative: `W` frees everything).
    #[must_use]
    pub fn per_stage(
        schedule: &Schedule,
        forward: f64,
        backward_input: f64,
        backward_weight: f64,
        p2p_latency: f64,
    ) -> Self {
        #[allow(clippy::cast_precision_loss)]
        let v = schedule.chunks() as f64;
        let c = ChunkCost {
            forward: forward / v,
            backward_input: backward_input / v,
            backward_weight: backward_weight / v,
            activation: 1.0 / v,
            weight_grad_memory: 1.0 / v,
        };
        Self {
            chunks: vec![c; schedule.placement().virtual_stages()],
            p2p_latency,
        }
    }

    /// Duration of `action` on virtual stage `vs`.
    fn duration(&self, vs: usize, a: &Action) -> f64 {
        let c = &self.chunks[vs];
        match a.kind {
            ActionKind::Forward => c.forward,
            ActionKind::Backward => c.backward_input + c.backward_weight,
            ActionKind::BackwardInput => c.backward_input,
            ActionKind::BackwardWeight => c.backward_weight,
        }
    }

    fn check(&self, schedule: &Schedule) -> Result<()> {
        let n = schedule.placement().virtual_stages();
        if self.chunks.len() != n {
            return Err(Error::InvalidParameter {
                name: "costs",
                value: format!("{} chunk costs", self.chunks.len()),
                expected: format!("one per virtual stage ({n} = stages × chunks)"),
            });
        }
        let bad = |name: &'static str, x: f64| Error::InvalidParameter {
            name,
            value: x.to_string(),
            expected: "a finite, non-negative number".into(),
        };
        if !(self.p2p_latency.is_finite() && self.p2p_latency >= 0.0) {
            return Err(bad("p2p_latency", self.p2p_latency));
        }
        for c in &self.chunks {
            for (name, x) in [
                ("forward cost", c.forward),
                ("backward_input cost", c.backward_input),
                ("backward_weight cost", c.backward_weight),
                ("activation memory", c.activation),
                ("weight_grad_memory", c.weight_grad_memory),
            ] {
                if !(x.is_finite() && x >= 0.0) {
                    return Err(bad(name, x));
                }
            }
        }
        Ok(())
    }
}

/// One action placed in time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    /// The action.
    pub action: Action,
    /// Virtual stage it runs.
    pub virtual_stage: usize,
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// The outcome of [`simulate`]: when each action ran, and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    name: String,
    microbatches: usize,
    chunks: usize,
    stages: Vec<Vec<Slot>>,
    /// Activation memory on each stage after each slot.
    memory: Vec<Vec<f64>>,
}

/// Run the dependency engine: every action starts when its stage is free
/// and its inputs have arrived. Returns slots per stage, or the deadlock.
pub(crate) fn run_engine(
    schedule: &Schedule,
    duration: &dyn Fn(usize, &Action) -> f64,
    latency: f64,
) -> Result<Vec<Vec<Slot>>> {
    let p = schedule.num_stages();
    let m = schedule.microbatches();
    let placement = schedule.placement();
    let nvs = placement.virtual_stages();
    let idx = |mb: usize, vs: usize| mb * nvs + vs;
    // End times: forward output, input gradient (B or BW), B alone.
    let mut fwd = vec![None::<f64>; m * nvs];
    let mut grad = vec![None::<f64>; m * nvs];
    let mut bin = vec![None::<f64>; m * nvs];
    let mut ptr = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut out: Vec<Vec<Slot>> = schedule
        .stages()
        .iter()
        .map(|l| Vec::with_capacity(l.len()))
        .collect();

    // The inputs of `a` on `stage`: Ok(ready time) or Err(missing action,
    // its stage); the missing backward's kind as its stage lists it only
    // when `name` (a search of that list: for the deadlock's report).
    let ready = |stage: usize,
                 a: &Action,
                 fwd: &[Option<f64>],
                 grad: &[Option<f64>],
                 bin: &[Option<f64>],
                 name: bool|
     -> std::result::Result<f64, (Action, usize)> {
        let vs = placement.virtual_stage(stage, a.chunk);
        let mb = a.microbatch;
        let mut t = 0.0f64;
        let mut need = |table: &[Option<f64>], dep_vs: usize, kind: ActionKind| {
            let (dep_stage, dep_chunk) = placement.location(dep_vs);
            match table[idx(mb, dep_vs)] {
                Some(end) => {
                    let arrive = if dep_stage == stage {
                        end
                    } else {
                        end + latency
                    };
                    t = t.max(arrive);
                    Ok(())
                }
                None => Err((
                    Action {
                        kind,
                        microbatch: mb,
                        chunk: dep_chunk,
                    },
                    dep_stage,
                )),
            }
        };
        match a.kind {
            ActionKind::Forward => {
                if vs > 0 {
                    need(fwd, vs - 1, ActionKind::Forward)?;
                }
            }
            ActionKind::Backward | ActionKind::BackwardInput => {
                need(fwd, vs, ActionKind::Forward)?;
                if vs + 1 < nvs {
                    // Name the kind the producer stage actually lists.
                    let (ps, pc) = placement.location(vs + 1);
                    let listed = || {
                        schedule.stages()[ps].iter().find(|x| {
                            x.microbatch == mb
                                && x.chunk == pc
                                && matches!(
                                    x.kind,
                                    ActionKind::Backward | ActionKind::BackwardInput
                                )
                        })
                    };
                    let kind = name
                        .then(listed)
                        .flatten()
                        .map_or(ActionKind::Backward, |x| x.kind);
                    need(grad, vs + 1, kind)?;
                }
            }
            ActionKind::BackwardWeight => need(bin, vs, ActionKind::BackwardInput)?,
        }
        Ok(t)
    };

    loop {
        let mut progress = false;
        for stage in 0..p {
            let list = &schedule.stages()[stage];
            while ptr[stage] < list.len() {
                let a = list[ptr[stage]];
                let Ok(t) = ready(stage, &a, &fwd, &grad, &bin, false) else {
                    break;
                };
                let vs = placement.virtual_stage(stage, a.chunk);
                let start = free[stage].max(t);
                let end = start + duration(vs, &a);
                free[stage] = end;
                let k = idx(a.microbatch, vs);
                match a.kind {
                    ActionKind::Forward => fwd[k] = Some(end),
                    ActionKind::Backward => grad[k] = Some(end),
                    ActionKind::BackwardInput => {
                        grad[k] = Some(end);
                        bin[k] = Some(end);
                    }
                    ActionKind::BackwardWeight => {}
                }
                out[stage].push(Slot {
                    action: a,
                    virtual_stage: vs,
                    start,
                    end,
                });
                ptr[stage] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    if (0..p).all(|s| ptr[s] == schedule.stages()[s].len()) {
        return Ok(out);
    }
    let stuck: Vec<_> = (0..p)
        .map(|s| {
            let list = &schedule.stages()[s];
            let step = ptr[s];
            let a = *list.get(step)?;
            let (waits_for, on_stage) = ready(s, &a, &fwd, &grad, &bin, true).err()?;
            Some((step, a, waits_for, on_stage))
        })
        .collect();
    Err(deadlock(&stuck))
}

/// Simulate `schedule` with `costs`: each action starts as soon as its stage
/// is free and its inputs have arrived (outputs of other stages arrive
/// `p2p_latency` after they are produced).
///
/// # Errors
/// Whatever [`validate`](crate::validate()) reports for the schedule;
/// [`Error::InvalidParameter`] when `costs` does not have one finite,
/// non-negative entry per virtual stage.
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Timeline> {
    costs.check(schedule)?;
    check_structure(schedule)?;
    let stages = run_engine(schedule, &|vs, a| costs.duration(vs, a), costs.p2p_latency)?;
    let memory = stages
        .iter()
        .map(|slots| {
            let mut now = 0.0f64;
            slots
                .iter()
                .map(|s| {
                    let c = &costs.chunks[s.virtual_stage];
                    match s.action.kind {
                        ActionKind::Forward => now += c.activation,
                        ActionKind::Backward => now -= c.activation,
                        ActionKind::BackwardInput => now -= c.activation - c.weight_grad_memory,
                        ActionKind::BackwardWeight => now -= c.weight_grad_memory,
                    }
                    now
                })
                .collect()
        })
        .collect();
    Ok(Timeline {
        name: schedule.name().to_owned(),
        microbatches: schedule.microbatches(),
        chunks: schedule.chunks(),
        stages,
        memory,
    })
}

/// The iteration period when iterations run back to back with no global
/// synchronisation between them (each stage starts iteration `k + 1` as
/// soon as its own part of iteration `k` is done — the optimizer-step
/// "post-validation" of Qi et al.). Measured by simulating several
/// iterations and taking the spacing of the last two.
///
/// # Errors
/// As [`simulate`].
pub fn steady_state_period(schedule: &Schedule, costs: &Costs) -> Result<f64> {
    const ITERS: usize = 5;
    let m = schedule.microbatches();
    let stages = schedule
        .stages()
        .iter()
        .map(|list| {
            (0..ITERS)
                .flat_map(|r| {
                    list.iter().map(move |a| Action {
                        microbatch: a.microbatch + r * m,
                        ..*a
                    })
                })
                .collect()
        })
        .collect();
    let repeated = Schedule::new(schedule.name(), m * ITERS, schedule.placement(), stages)?;
    let t = simulate(&repeated, costs)?;
    let end_of = |r: usize| {
        t.stages
            .iter()
            .flat_map(|s| s.iter())
            .filter(|s| s.action.microbatch / m.max(1) == r)
            .map(|s| s.end)
            .fold(0.0f64, f64::max)
    };
    Ok(end_of(ITERS - 1) - end_of(ITERS - 2))
}

impl Timeline {
    /// A timeline from its parts (the executor's measured timelines).
    pub(crate) fn from_parts(
        name: String,
        microbatches: usize,
        chunks: usize,
        stages: Vec<Vec<Slot>>,
        memory: Vec<Vec<f64>>,
    ) -> Self {
        Timeline {
            name,
            microbatches,
            chunks,
            stages,
            memory,
        }
    }

    /// Name of the simulated schedule.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Stages `p`.
    #[must_use]
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }
    /// Micro-batches `m`.
    #[must_use]
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }
    /// Chunks per stage `v`.
    #[must_use]
    pub fn chunks(&self) -> usize {
        self.chunks
    }
    /// The slots of `stage`, in execution order.
    ///
    /// # Panics
    /// When `stage >= num_stages()`.
    #[must_use]
    pub fn slots(&self, stage: usize) -> &[Slot] {
        &self.stages[stage]
    }
    /// End of the last action on any stage (all stages start at 0).
    #[must_use]
    pub fn makespan(&self) -> f64 {
        self.stages
            .iter()
            .flatten()
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }
    /// Time `stage` spends computing.
    ///
    /// # Panics
    /// When `stage >= num_stages()`.
    #[must_use]
    pub fn busy(&self, stage: usize) -> f64 {
        self.stages[stage].iter().map(|s| s.end - s.start).sum()
    }
    /// Time `stage` is idle within `[0, makespan]`.
    ///
    /// # Panics
    /// When `stage >= num_stages()`.
    #[must_use]
    pub fn idle(&self, stage: usize) -> f64 {
        self.makespan() - self.busy(stage)
    }
    /// The bubble: idle time over all stages divided by `p × makespan`,
    /// for one iteration that ends with a synchronisation of all stages
    /// (Megatron-LM's accounting). 0 for an empty timeline.
    #[must_use]
    pub fn bubble_fraction(&self) -> f64 {
        let total = self.makespan();
        if total <= 0.0 {
            return 0.0;
        }
        let busy: f64 = (0..self.num_stages()).map(|s| self.busy(s)).sum();
        #[allow(clippy::cast_precision_loss)]
        let p = self.num_stages() as f64;
        1.0 - busy / (p * total)
    }
    /// The bubble when iterations run back to back with period `period`
    /// (from [`steady_state_period`]): `1 − busy / (p × period)`.
    #[must_use]
    pub fn bubble_fraction_at_period(&self, period: f64) -> f64 {
        if period <= 0.0 {
            return 0.0;
        }
        let busy: f64 = (0..self.num_stages()).map(|s| self.busy(s)).sum();
        #[allow(clippy::cast_precision_loss)]
        let p = self.num_stages() as f64;
        1.0 - busy / (p * period)
    }
    /// Peak activation memory of each stage, in the unit of the costs'
    /// `activation`.
    #[must_use]
    pub fn peak_memory(&self) -> Vec<f64> {
        self.memory
            .iter()
            .map(|m| m.iter().copied().fold(0.0, f64::max))
            .collect()
    }
    /// Activation memory of `stage` after each of its slots.
    ///
    /// # Panics
    /// When `stage >= num_stages()`.
    #[must_use]
    pub fn memory_after(&self, stage: usize) -> &[f64] {
        &self.memory[stage]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Placement;

    #[test]
    fn two_stage_gpipe_by_hand() {
        // F=1, BW=2, latency 0.5: stage 1 starts F0 at 1.5.
        let stages = vec![
            vec![
                Action::forward(0, 0),
                Action::forward(1, 0),
                Action::backward(0, 0),
                Action::backward(1, 0),
            ],
            vec![
                Action::forward(0, 0),
                Action::forward(1, 0),
                Action::backward(0, 0),
                Action::backward(1, 0),
            ],
        ];
        let s = Schedule::new(
            "g",
            2,
            Placement::Interleaved {
                stages: 2,
                chunks: 1,
            },
            stages,
        )
        .unwrap();
        let c = Costs::per_stage(&s, 1.0, 1.0, 1.0, 0.5);
        let t = simulate(&s, &c).unwrap();
        let ends: Vec<f64> = t.slots(1).iter().map(|x| x.end).collect();
        assert_eq!(ends, vec![2.5, 3.5, 5.5, 7.5]);
        let ends: Vec<f64> = t.slots(0).iter().map(|x| x.end).collect();
        // BW0 on stage 0 waits for stage 1's BW0 (5.5) + 0.5.
        assert_eq!(ends, vec![1.0, 2.0, 8.0, 10.0]);
        assert_eq!(t.makespan(), 10.0);
        assert_eq!(t.busy(0), 6.0);
        assert_eq!(t.bubble_fraction(), 1.0 - 12.0 / 20.0);
        assert_eq!(t.peak_memory(), vec![2.0, 2.0]);
    }

    #[test]
    fn rejects_bad_costs() {
        let s = crate::generate::one_f_one_b(2, 2).unwrap();
        let mut c = Costs::per_stage(&s, 1.0, 1.0, 1.0, 0.0);
        c.chunks[1].forward = f64::NAN;
        assert!(
            simulate(&s, &c)
                .unwrap_err()
                .to_string()
                .contains("forward cost = NaN")
        );
        c.chunks.pop();
        assert!(
            simulate(&s, &c)
                .unwrap_err()
                .to_string()
                .contains("one per virtual stage")
        );
        let c = Costs {
            p2p_latency: -1.0,
            ..Costs::per_stage(&s, 1.0, 1.0, 1.0, 0.0)
        };
        assert!(simulate(&s, &c).is_err());
    }
}
