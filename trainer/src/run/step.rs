//! One optimizer step of a rank: its micro-batches of the step's batch
//! (the next one not left out), the drilled faults that belong to it, and
//! the model's step.

use std::time::{Duration, Instant};

use weft_data::{Batch, Dataset};
use weft_kernels::OptimStep;
use weft_model::{MicroBatch, StepOutcome, TrainModel};

use crate::run::faults::FaultPlan;
use crate::train::TrainError;

/// The batches' token and target ids as the model's micro-batches.
pub(crate) fn micro_batches(batches: &[Batch]) -> Vec<MicroBatch<'_>> {
    batches
        .iter()
        .map(|b| MicroBatch {
            tokens: &b.inputs,
            targets: &b.targets,
        })
        .collect()
}

/// What one step of a rank needs besides the model.
pub(crate) struct StepInput<'a> {
    /// The run's data.
    pub data: &'a Dataset,
    /// The run's faults.
    pub faults: &'a FaultPlan,
    /// The run folder, on the rank that records what fires (world rank 0).
    pub writer: Option<&'a std::path::Path>,
    /// This rank's world rank.
    pub rank: usize,
}

/// What a step did.
pub(crate) struct StepDone {
    /// The model's outcome.
    pub out: StepOutcome,
    /// Seconds inside the model's step.
    pub in_step: f64,
    /// The time a `slow` fault slept before it.
    pub slept: Duration,
}

/// Runs step `step` (1-based) on `model`: this rank's micro-batches
/// `micros` (of `micro` sequences) of the 0-based batch `batch`, with the
/// faults of the step — `slow` sleeps the last step's own time `last`
/// again per unit of its factor, `spike` garbles the batch, `nan` makes
/// the first parameter this rank holds NaN for the step (put back
/// after) — and the optimizer at `hp`, the loss scaled by `loss_scale`.
///
/// # Errors
/// The data's and the model's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step<M: TrainModel + ?Sized>(
    model: &mut M,
    input: &StepInput<'_>,
    step: u64,
    (batch, micros, micro): (u64, std::ops::Range<usize>, usize),
    hp: &OptimStep,
    clip: f64,
    loss_scale: f32,
    last: Duration,
) -> Result<StepDone, TrainError> {
    let mut batches: Vec<Batch> = micros
        .map(|m| input.data.train_batch(batch, m, micro))
        .collect::<Result<_, _>>()?;
    let vocab = input.data.vocab_size();
    for b in &mut batches {
        input
            .faults
            .spike_at(batch + 1, &mut b.targets, vocab, input.writer);
    }
    let slept = last.mul_f64(input.faults.slowdown(step, input.rank) - 1.0);
    std::thread::sleep(slept);
    let poisoned = if input.faults.nan_at(batch + 1, input.writer) {
        poison(model)?
    } else {
        None
    };
    let mbs = micro_batches(&batches);
    let began = Instant::now();
    let out = model.train_step(&mbs, hp, clip, loss_scale)?;
    model.finish_step()?;
    let in_step = began.elapsed().as_secs_f64();
    if let Some((name, values)) = poisoned {
        model.write_param(&name, &values)?;
    }
    Ok(StepDone {
        out,
        in_step,
        slept,
    })
}

/// A `nan` fault: the first parameter tensor this rank holds gets a NaN
/// (collective where the model's reads are: every rank calls it); returns
/// the tensor's name and values to put back after the step.
fn poison<M: TrainModel + ?Sized>(model: &mut M) -> Result<Option<(String, Vec<f32>)>, TrainError> {
    let names: Vec<String> = model
        .whole_layout()
        .specs()
        .iter()
        .map(|s| s.name.clone())
        .collect();
    for name in names {
        if let Some(values) = model.read_param(&name)? {
            let mut bad = values.clone();
            if let Some(v) = bad.first_mut() {
                *v = f32::NAN;
            }
            model.write_param(&name, &bad)?;
            return Ok(Some((name, values)));
        }
    }
    Ok(None)
}
