//! `weft plan --calibrate`: the planner against this machine. Several
//! `weft train` layouts run, and the machine is measured, in rounds (a
//! shared machine's other jobs come and go over seconds); the prediction
//! from the rounds' best figures is compared with each layout's quietest
//! round.
//!
//! A step does more than products and element-wise passes (the pool's
//! wake-ups, copies and zeroing, the exact sums), so the share of the
//! measured rates a step reaches is measured too, on a one-rank layout
//! with each pool size (the references), and every layout is predicted at
//! its pool's: the references are the calibration, the parallel layouts
//! the check.
//!
//! This crate measures the machine ([`MachineProfile`]) and does the
//! arithmetic; running a layout is the caller's ([`Runner`]): the trainer
//! runs `weft train` in-process.

use serde::Serialize;

use crate::layout::Layout;
use crate::machine::MachineProfile;
use crate::memory::Memory;
use crate::model::ModelSpec;
use crate::predict::{Prediction, predict};
use crate::{Recipe, Request};

/// A calibration layout's figures: of one run, or of the quietest of
/// several rounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measured {
    /// Median seconds per step (the first fifth of the steps not counted);
    /// over rounds, the lowest round's.
    pub step_s: f64,
    /// The fastest step (of every round).
    pub best_step_s: f64,
    /// Each round's median seconds per step, in order (one for a single
    /// run): their spread is the machine's noise.
    pub round_step_s: Vec<f64>,
    /// Steps timed.
    pub steps: usize,
    /// Memory of rank 0 as the built model allocated it.
    pub memory: Memory,
}

impl Measured {
    /// One run's figures from its steps' times, in order (the first fifth
    /// is the warm-up, not counted), and rank 0's memory; `None` when no
    /// step is left to time.
    #[must_use]
    pub fn of_run(step_s: &[f64], memory: Memory) -> Option<Self> {
        let mut timed: Vec<f64> = step_s[step_s.len() / 5..].to_vec();
        timed.sort_by(f64::total_cmp);
        let median = *timed.get(timed.len() / 2)?;
        Some(Self {
            step_s: median,
            best_step_s: timed[0],
            round_step_s: vec![median],
            steps: timed.len(),
            memory,
        })
    }

    /// The quietest of several rounds' runs (the lowest median), with the
    /// fastest step of all and every round's median.
    fn quietest(rounds: &[Measured]) -> Option<Self> {
        let q = rounds.iter().min_by(|a, b| a.step_s.total_cmp(&b.step_s))?;
        Some(Self {
            step_s: q.step_s,
            best_step_s: rounds
                .iter()
                .map(|m| m.best_step_s)
                .fold(f64::INFINITY, f64::min),
            round_step_s: rounds.iter().map(|m| m.step_s).collect(),
            steps: q.steps,
            memory: q.memory,
        })
    }
}

/// One job of a calibration, as the [`Runner`] describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The `--set` arguments of the layout over the base job.
    pub sets: Vec<String>,
    /// Its layout.
    pub layout: Layout,
    /// Kernel threads of each rank.
    pub threads: usize,
    /// Sequences per step.
    pub batch: usize,
    /// What its ranks hold and compute.
    pub recipe: Recipe,
}

/// What runs the layouts of a calibration.
pub trait Runner {
    /// A job's or a run's failure; the planner's errors convert into it.
    type Error: From<crate::Error>;
    /// The job `sets` (`--set` arguments) make of the base job, checked.
    ///
    /// # Errors
    /// The settings are wrong for the job.
    fn job(&mut self, sets: &[String]) -> Result<Job, Self::Error>;
    /// Runs `job` for `steps` steps: [`Measured::of_run`] of its step
    /// times and rank 0's memory.
    ///
    /// # Errors
    /// The run failed.
    fn run(&mut self, job: &Job, steps: u64) -> Result<Measured, Self::Error>;
}

/// What to calibrate with.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The job's model.
    pub model: ModelSpec,
    /// Tokens of a micro-batch (the products measured are the model's at
    /// this many rows).
    pub tokens: usize,
    /// Whether the job sums reproducibly (the all-reduce is measured so).
    pub reproducible: bool,
    /// The layouts, as `--set` arguments ([`layouts`] by default).
    pub layouts: Vec<Vec<String>>,
    /// Steps per run (the first fifth is not timed).
    pub steps: u64,
    /// Rounds: each runs every layout, then measures the machine.
    pub rounds: usize,
}

/// One calibration layout: predicted against measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CalibrationRow {
    /// The `--set` arguments of the layout.
    pub sets: Vec<String>,
    /// Kernel threads of each rank.
    pub threads: usize,
    /// Whether this is the one-rank reference its pool size's efficiency
    /// was measured on (its prediction then matches by construction).
    pub reference: bool,
    /// The planner's prediction.
    pub predicted: Prediction,
    /// What the run measured.
    pub measured: Measured,
    /// `(predicted − measured) / measured` of the step time (the median
    /// step).
    pub step_error: f64,
    /// The same against the fastest step: the measurements of the machine
    /// are each the best of several (a shared machine only slows them), so
    /// this compares like with like; the median includes other jobs.
    pub fastest_error: f64,
    /// `(predicted − measured) / measured` of rank 0's memory.
    pub memory_error: f64,
}

/// The layouts `--calibrate` runs: dp=1, dp=2, dp=2 with FSDP (ZeRO-3),
/// tp=2, pp=2 (1F1B), as `--set` arguments.
#[must_use]
pub fn layouts() -> Vec<Vec<String>> {
    [
        vec![],
        vec!["parallel.dp=2"],
        vec!["parallel.dp=2", "parallel.fsdp=\"full\""],
        vec!["parallel.tp=2"],
        vec!["parallel.pp=2"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(str::to_owned).collect())
    .collect()
}

/// What `--calibrate` found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// This machine: the best figures of every round's measurement.
    pub machine: MachineProfile,
    /// Rounds run (each runs every layout, then measures the machine).
    pub rounds: usize,
    /// For each pool size the layouts' ranks have: the share of the
    /// measured product and memory rates a `weft train` step reaches,
    /// measured on a one-rank job with that pool (the reference). What a
    /// step does besides products and element-wise passes — the pool's
    /// wake-ups, copies and zeroing, the exact sums — makes it less than
    /// 1. Every layout is predicted at its pool's.
    pub efficiency: Vec<PoolEfficiency>,
    /// Each layout, predicted from `machine` against its quietest round;
    /// the references (one rank, a pool of each size) first, flagged.
    pub layouts: Vec<CalibrationRow>,
}

/// A pool size's step efficiency ([`Calibration::efficiency`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolEfficiency {
    /// Kernel threads of the pool.
    pub threads: usize,
    /// The share of the measured rates a step reaches.
    pub efficiency: f64,
}

/// The settings of a one-rank job with pools of `threads` threads: the
/// reference of that pool size.
fn reference_sets(threads: usize) -> Vec<String> {
    [
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.ep=1",
        "parallel.fsdp=\"none\"",
        "parallel.sequence_parallel=false",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([format!("parallel.threads={threads}")])
    .collect()
}

/// A job and whether it is its pool's reference.
struct Entry {
    job: Job,
    reference: bool,
}

/// The plan's layouts and a one-rank reference for each pool size they
/// have (a layout itself where one runs on one rank), references first;
/// and the pool sizes.
fn entries<R: Runner>(runner: &mut R, plan: &Plan) -> Result<(Vec<Entry>, Vec<usize>), R::Error> {
    let mut jobs = Vec::with_capacity(plan.layouts.len() + 2);
    for sets in &plan.layouts {
        jobs.push(Entry {
            job: runner.job(sets)?,
            reference: false,
        });
    }
    let mut pools: Vec<usize> = jobs.iter().map(|e| e.job.threads).collect();
    pools.sort_unstable();
    pools.dedup();
    for &t in &pools {
        if let Some(e) = jobs
            .iter_mut()
            .find(|e| e.job.layout.world() == 1 && e.job.threads == t)
        {
            e.reference = true;
        } else {
            jobs.push(Entry {
                job: runner.job(&reference_sets(t))?,
                reference: true,
            });
        }
    }
    // stable: the references in pool order, then the layouts in order
    jobs.sort_by_key(|e| !e.reference);
    Ok((jobs, pools))
}

/// Runs each layout of `plan` (and a one-rank reference for each pool
/// size the layouts' ranks have, `parallel.threads`) and measures this
/// machine, `plan.rounds` times over; then predicts each layout from the
/// machine's best figures, at its pool's efficiency measured on its
/// reference, and compares the prediction with the layout's quietest
/// round (the lowest median step) and its fastest step. Both sides are
/// thus the machine at its least disturbed: a shared machine's other jobs
/// come and go over seconds, and slow whatever runs meanwhile — a
/// measurement or a layout — never speed it up. `say` receives a line per
/// run and per measurement.
///
/// # Errors
/// A layout's configuration error (before anything runs); the planner's;
/// a run's.
///
/// # Panics
/// If a rayon pool cannot be built for the measurement.
pub fn calibrate<R: Runner>(
    runner: &mut R,
    plan: &Plan,
    say: &mut dyn FnMut(&str),
) -> Result<Calibration, R::Error> {
    let rounds = plan.rounds.max(1);
    let steps = plan.steps;
    let (jobs, pools) = entries(runner, plan)?;
    let mut profiles = Vec::with_capacity(rounds);
    let mut runs: Vec<Vec<Measured>> = vec![Vec::with_capacity(rounds); jobs.len()];
    for round in 1..=rounds {
        for (e, got) in jobs.iter().zip(&mut runs) {
            let m = runner.run(&e.job, steps)?;
            say(&format!(
                "calibrate     round {round}/{rounds}: {} ({} thread{}{}): {steps} steps, median {:.2} ms",
                e.job.layout,
                e.job.threads,
                if e.job.threads == 1 { "" } else { "s" },
                if e.reference { ", reference" } else { "" },
                1e3 * m.step_s
            ));
            got.push(m);
        }
        say(&format!(
            "calibrate     round {round}/{rounds}: measuring this machine"
        ));
        profiles.push(MachineProfile::measure(
            &plan.model,
            plan.tokens,
            plan.reproducible,
        ));
    }
    let machine = MachineProfile::best(&profiles).expect("at least one round");
    let request = |j: &Job, efficiency: f64| Request {
        model: plan.model.clone(),
        batch: j.batch,
        cluster: machine.cluster_at(j.layout.world(), j.threads, efficiency),
        recipe: j.recipe,
    };
    let measured: Vec<Measured> = runs.iter().filter_map(|r| Measured::quietest(r)).collect();
    // each pool's efficiency: its reference's prediction brought to its
    // measurement (products and element-wise work scale with it; the
    // kernels' fixed costs do not, hence a few rounds of the fixed point)
    let mut efficiency = Vec::with_capacity(pools.len());
    for (e, m) in jobs.iter().zip(&measured).filter(|(e, _)| e.reference) {
        let mut eff = 1.0;
        for _ in 0..4 {
            let p = predict(&request(&e.job, eff), &e.job.layout)?;
            eff = (eff * p.step_s / m.step_s).clamp(0.05, 2.0);
        }
        efficiency.push(PoolEfficiency {
            threads: e.job.threads,
            efficiency: eff,
        });
    }
    let mut rows = Vec::with_capacity(jobs.len());
    for (e, measured) in jobs.iter().zip(measured) {
        let j = &e.job;
        let eff = efficiency
            .iter()
            .find(|p| p.threads == j.threads)
            .map_or(1.0, |p| p.efficiency);
        let predicted = predict(&request(j, eff), &j.layout)?;
        let total = measured.memory.total() as f64;
        rows.push(CalibrationRow {
            sets: j.sets.clone(),
            threads: j.threads,
            reference: e.reference,
            step_error: (predicted.step_s - measured.step_s) / measured.step_s,
            fastest_error: (predicted.step_s - measured.best_step_s) / measured.best_step_s,
            memory_error: (predicted.memory_rank0.total() as f64 - total) / total,
            predicted,
            measured,
        });
    }
    Ok(Calibration {
        machine,
        rounds,
        efficiency,
        layouts: rows,
    })
}

fn mb(b: f64) -> String {
    format!("{:.1} MB", b / 1e6)
}

/// The calibration as a Markdown table, with the machine it ran on.
#[must_use]
pub fn table(cal: &Calibration) -> String {
    let profile = &cal.machine;
    let figs: Vec<String> = profile
        .per_threads
        .iter()
        .map(|f| {
            format!(
                "{} thread(s): f32 products {:.1} GFLOP/s, bf16 {:.1}, {:.1} µs per call, memory {:.1} GB/s",
                f.threads,
                f.gemm_f32 / 1e9,
                f.gemm_bf16 / 1e9,
                f.overhead * 1e6,
                f.memory_bandwidth / 1e9
            )
        })
        .collect();
    let mut s = format!(
        "this machine (best of {} round(s)): {} ({} cores); {}; all-reduce between 2 thread ranks{}: α {:.1} µs, β {:.2} GB/s\n\
         weft train's step reaches {} of these product and memory rates (measured on one rank, the reference; every other layout is predicted)\n\n\
         | layout | threads per rank | predicted step | measured step (median{}) | error | fastest step | error | each round's median | predicted memory (rank 0) | measured memory | error |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        cal.rounds,
        profile.cpu,
        profile.cores,
        figs.join("; "),
        if profile.reproducible {
            " (reproducible sums)"
        } else {
            ""
        },
        profile.link.latency * 1e6,
        profile.link.bandwidth / 1e9,
        cal.efficiency
            .iter()
            .map(|p| format!(
                "{:.1}% with {} thread{}",
                100.0 * p.efficiency,
                p.threads,
                if p.threads == 1 { "" } else { "s" }
            ))
            .collect::<Vec<_>>()
            .join(", "),
        if cal.rounds > 1 {
            ", quietest round"
        } else {
            ""
        }
    );
    for r in &cal.layouts {
        let rounds: Vec<String> = r
            .measured
            .round_step_s
            .iter()
            .map(|t| format!("{:.1}", 1e3 * t))
            .collect();
        s.push_str(&format!(
            "| {}{} | {} | {:.2} ms | {:.2} ms | {:+.1}% | {:.2} ms | {:+.1}% | {} ms | {} | {} | {:+.2}% |\n",
            r.predicted.layout,
            if r.reference { " (reference)" } else { "" },
            r.threads,
            1e3 * r.predicted.step_s,
            1e3 * r.measured.step_s,
            100.0 * r.step_error,
            1e3 * r.measured.best_step_s,
            100.0 * r.fastest_error,
            rounds.join(", "),
            mb(r.predicted.memory_rank0.total() as f64),
            mb(r.measured.memory.total() as f64),
            100.0 * r.memory_error
        ));
    }
    s
}
