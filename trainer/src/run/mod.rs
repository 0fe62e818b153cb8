//! The training loop, once for every model and layout, and the run folder
//! it writes.
//!
//! Every rank of a job runs [`attempt`] (SPMD) against a
//! [`TrainModel`] built for it ([`build`]: the
//! CPU's `ParallelGpt` on the job's mesh, or the GPU's `CudaGpt`); the
//! ranks differ only in their part of the model and of the batch. Per
//! step: this rank's micro-batches of the step's batch ([`step`]), the
//! model's step (forward, backward, reduction, exact norm, clipping,
//! AdamW), the experts' load and balancing ([`experts`]), the health
//! checks and the rewind they may ask for ([`health`]), the step's
//! traces, traffic and work time ([`tracing`]), the metrics line,
//! evaluation, a checkpoint ([`saving`]) and a clean stop. The loop
//! starts in [`setup`] (where the ranks run, what they agree on before
//! anything is built) and writes the run folder ([`folder`]):
//!
//! * `config.toml` — the resolved configuration;
//! * `metrics.jsonl` — one `MetricsRecord` per step, and a `MetricsEvent`
//!   per evaluation and health event;
//! * `events.jsonl` — rewinds, stragglers and drilled faults (and a
//!   supervisor's starts, failures and restarts);
//! * `summary.json` — the final figures;
//! * `checkpoints/` — every rank's part of the model, each element
//!   written once, by its owner; a checkpoint loads on any layout;
//! * `expert_load.jsonl` (mixture of experts) and `trace.json` (pipeline
//!   timelines, FSDP's compute and communication tracks);
//! * `heartbeats/` — the last step of every rank, for a supervisor.
//!
//! Faults to drill the run with come in through a [`faults::FaultPlan`].

pub(crate) mod board;
pub(crate) mod build;
pub(crate) mod experts;
pub(crate) mod faults;
pub(crate) mod folder;
pub(crate) mod health;
pub(crate) mod saving;
pub(crate) mod setup;
pub(crate) mod step;
pub(crate) mod tracing;

use std::time::{Duration, Instant};

use weft_collectives::{Communicator, CommunicatorExt, ReduceOp};
use weft_model::TrainModel;
use weft_supervise::health::SkipList;
use weft_trace::{EventKind, Summary};

use crate::ranks::agree;
use crate::run::build::Built;
use crate::run::experts::Experts;
use crate::run::folder::{Kept, Metrics};
use crate::run::health::{Health, Stragglers, skips_for_run};
use crate::run::setup::Job;
use crate::run::step::{StepInput, micro_batches};
use crate::run::tracing::{Tracer, work_time};
use crate::train::{Observer, TrainError};

/// How an attempt at the run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// A new run folder.
    New,
    /// From the newest checkpoint that verifies (`--resume`).
    Resume,
    /// Rewound: from the newest checkpoint that verifies, or from the
    /// start when none was saved (`checkpoint = false`).
    Rewind {
        /// Whether a checkpoint was saved to go back to.
        checkpoint: bool,
    },
}

/// How an attempt ended.
pub(crate) enum Attempt {
    /// The run trained to its last step.
    Finished(Box<Summary>),
    /// A rewind: go back to the checkpoint of `to` (0: none).
    Rewind {
        /// The step of the newest checkpoint saved (0: none).
        to: u64,
    },
}

/// Where an attempt continues from: the step, the `metrics.jsonl` lines
/// kept, the fp16 loss scaler's state.
struct Resumed {
    step: u64,
    kept: Kept,
    scale: Option<weft_numerics::LossScalerState>,
}

/// Loads every rank's part of the newest checkpoint (saved by any layout)
/// when the attempt continues a run, and reads the run's metrics up to
/// it. Collective over `world`.
fn resume<M: TrainModel>(
    job: &Job<'_>,
    world: &dyn Communicator,
    run_dir: &std::path::Path,
    model: &mut M,
    start: Start,
    observer: &mut dyn Observer,
) -> Result<Resumed, TrainError> {
    let mut resumed = Resumed {
        step: 0,
        kept: Kept::default(),
        scale: None,
    };
    if start == Start::New {
        return Ok(resumed);
    }
    if start != (Start::Rewind { checkpoint: false }) {
        let root = run_dir.join("checkpoints");
        let restored = saving::restore_sharded(world, &root, job.config, model);
        let restored = agree(world, restored.map_err(TrainError::from))?;
        if restored.step >= job.config.train.steps {
            return Err(TrainError::AlreadyFinished {
                run: run_dir.to_owned(),
                step: restored.step,
            });
        }
        observer.resumed(restored.step, &restored.skipped);
        resumed.step = restored.step;
        resumed.scale = restored.loss_scale;
    }
    resumed.kept = Kept::read(world, run_dir, resumed.step)?;
    Ok(resumed)
}

/// Whether any rank of `world` has been asked to stop (collective: every
/// rank calls it after the same step; one rank needs no communication).
fn stop_agreed(world: &dyn Communicator) -> weft_collectives::Result<bool> {
    let mine = f32::from(u8::from(weft_supervise::stop::requested()));
    if world.size() == 1 {
        return Ok(mine > 0.0);
    }
    let mut any = [mine];
    world.all_reduce(&mut any, ReduceOp::Max)?;
    Ok(any[0] > 0.0)
}

/// One attempt at the run, from `start`, on this rank's model `built`;
/// `skips` is loaded by the first attempt and carried over rewinds. Only
/// world rank 0 writes the run folder's files; every rank its heartbeat
/// and its checkpoint parts.
///
/// # Errors
/// As [`crate::train::train`]; [`TrainError::Stopped`] after a stop was
/// asked for; [`TrainError::TooManyRewinds`].
pub(crate) fn attempt<M: TrainModel>(
    job: &Job<'_>,
    world: &dyn Communicator,
    mut built: Built<M>,
    observer: &mut dyn Observer,
    start: Start,
    skips: &mut Option<SkipList>,
) -> Result<Attempt, TrainError> {
    let (config, data) = (job.config, job.data);
    let t = &config.train;
    let (writer, rank) = (world.rank() == 0, world.rank());
    let split = config.batch_split()?;
    // held until the attempt ends: one writer per run folder
    let (run_dir, _lock) = folder::open_run_dir(config, world, start != Start::New)?;
    let model = &mut built.model;
    let resumed = resume(job, world, &run_dir, model, start, observer)?;
    let start_step = resumed.step;
    if skips.is_none() {
        let from = skips_for_run(world, &run_dir, start != Start::New, &t.skip_batches)?;
        *skips = Some(from);
    }
    let skips = skips.get_or_insert_with(SkipList::default);
    let mut health = Health::new(config, &resumed.kept, resumed.scale)?;
    let floor = data.val_floor(t.eval_sequences);
    let mut metrics = Metrics::open(world, &run_dir, &resumed.kept, floor)?;
    let board = board::open(config, &run_dir, writer, start_step)?;
    let observer = &mut board::Tee {
        inner: observer,
        board,
    };
    let val = data.val_batches(t.eval_sequences, split.micro);
    let val = agree(world, val.map_err(TrainError::from))?;
    let val_mbs = micro_batches(&val);
    let info = built.info(job, &run_dir);
    observer.start(&info);
    let model = &mut built.model;
    let mut experts = Experts::open(built.moe.take(), world, &run_dir, start_step)?;
    let dims = config.parallel.dims();
    let mut stragglers = Stragglers::new(config, dims);
    // one time origin for every rank's trace
    world.barrier()?;
    let origin = Instant::now();
    let mut tracer = Tracer::new(origin, dims, config.run.trace_steps);
    if start == Start::New {
        metrics.eval(observer, 0, model.eval_loss(&val_mbs)?)?;
    }
    weft_supervise::heartbeat(&run_dir, rank, start_step);
    if writer && matches!(start, Start::Rewind { .. }) {
        // rebuilt and restored: the rewind's cost ends here
        let kind = EventKind::Rewound { step: start_step };
        let _ =
            weft_supervise::events::append_event(&run_dir, &weft_supervise::events::stamped(kind));
    }
    let input = StepInput {
        data,
        faults: job.faults,
        writer: writer.then_some(run_dir.as_path()),
        rank,
    };
    // a rewind goes back to the newest checkpoint saved (0: the start)
    let mut saver = saving::Saver::new(world, config, &*model, &run_dir, start_step)?;
    let mut last_step_time = Duration::ZERO;
    for step in start_step + 1..=t.steps {
        job.faults.before_step(&run_dir, step, rank);
        let began = Instant::now();
        let lr = config.optim.lr_at(step - 1, t.steps);
        // the next batch not left out; this data-parallel rank's share
        let batch = skips.batch_of(step - 1);
        let micros = built.first_micro..built.first_micro + split.per_rank;
        let scale = health.loss_scale();
        experts.forget();
        let hp = config.optim.step_at(step - 1, t.steps);
        let clip = config.optim.grad_clip;
        let done = step::step(
            model,
            &input,
            step,
            (batch, micros, split.micro),
            &hp,
            clip,
            scale.unwrap_or(1.0),
            last_step_time,
        )?;
        let (max_vio, loads) = experts.step(model, step, done.out.applied)?;
        observer.experts(&loads);
        let position = (batch, split.global);
        let checked = health.check(step, &done.out, position, scale, &mut metrics, observer)?;
        if let Some(cause) = checked {
            metrics.flush()?;
            experts.flush()?;
            saver.wait(world, observer)?;
            let to = saver.committed;
            health::rewind(world, &run_dir, config, skips, step, cause, to, observer)?;
            return Ok(Attempt::Rewind { to });
        }
        let telemetry = model.take_telemetry();
        let work = work_time(began.elapsed().as_secs_f64(), done.in_step, &telemetry);
        let nth = step - start_step - 1;
        tracer.step(world, model.schedule(), telemetry, (step, nth, began))?;
        last_step_time = began.elapsed().saturating_sub(done.slept);
        let times = (began.elapsed(), origin.elapsed());
        let report = metrics.step(&info, step, lr, &done.out, scale, times, max_vio)?;
        weft_supervise::heartbeat(&run_dir, rank, step);
        stragglers.step(world, step, work, &run_dir, observer)?;
        observer.step(&report);
        observer.check()?;
        let last = step == t.steps;
        if last || (t.eval_every > 0 && step.is_multiple_of(t.eval_every)) {
            metrics.eval(observer, step, model.eval_loss(&val_mbs)?)?;
        }
        // a stop asked for on any rank: every rank saves after this step
        let stop = !last && stop_agreed(world)?;
        let every = config.checkpoint.every;
        if stop || every > 0 && (last || step.is_multiple_of(every)) {
            // everything logged so far belongs to the checkpoint
            metrics.flush()?;
            experts.flush()?;
            let req = saving::SaveRequest {
                step,
                loss_scale: health.scaler_state(),
                model: &built.gpt,
                mesh: config.parallel.dims().mesh_dims().to_vec(),
            };
            saver.save(world, config, &*model, req, job.faults, observer)?;
        }
        if stop {
            // the save in flight ends before the run does
            saver.wait(world, observer)?;
            return Err(TrainError::Stopped { step, run: run_dir });
        }
    }
    saver.wait(world, observer)?;
    metrics.flush()?;
    experts.flush()?;
    let summary = Summary {
        final_max_vio: metrics.last_max_vio(),
        pipeline_bubble: tracer.bubble(config.parallel.pp_schedule.name()),
        traffic_per_step: tracer.traffic(world)?,
        operand_copy_bytes: weft_kernels::operand_copy_bytes() as u64,
        ..metrics.summary(&info, origin.elapsed())
    };
    tracer.write(writer, &run_dir)?;
    folder::finish(writer, &summary, observer)?;
    observer.check()?;
    Ok(Attempt::Finished(Box::new(summary)))
}
