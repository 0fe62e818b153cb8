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

use crate::cluster::Link;
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
    /// FSDP's communication per step, where the run traced it: seconds
    /// its collectives were in flight and seconds the step waited on
    /// them (the exposed part), each rank's mean (of the quietest round).
    pub fsdp: Option<FsdpTime>,
}

/// FSDP's communication of a step as a run's trace measured it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct FsdpTime {
    /// Seconds its all-gathers and reduce-scatters were in flight.
    pub comm_s: f64,
    /// Seconds the training thread waited on them.
    pub exposed_s: f64,
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
            fsdp: None,
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
            fsdp: q.fsdp,
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
    /// Ranks per node when its ranks run on nodes of their own network
    /// ([`Runner::network`]); 0 when they share one machine's memory.
    pub per_node: usize,
}

/// One layout to calibrate: its `--set` arguments, and where its ranks go.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Trial {
    /// The `--set` arguments of the layout over the base job.
    pub sets: Vec<String>,
    /// Ranks per node on a cluster of nodes (0: every rank in one
    /// process, on thread ranks).
    pub per_node: usize,
    /// Part of the communication crossover ([`Calibration::crossover`]):
    /// pure FSDP over more and more nodes at one global batch.
    pub crossover: bool,
}

impl Trial {
    /// A layout on thread ranks of one process.
    #[must_use]
    pub fn threads(sets: &[&str]) -> Self {
        Trial {
            sets: sets.iter().map(|s| (*s).to_owned()).collect(),
            per_node: 0,
            crossover: false,
        }
    }

    /// A layout whose ranks run `per_node` to a node.
    #[must_use]
    pub fn nodes(sets: &[&str], per_node: usize) -> Self {
        Trial {
            per_node,
            ..Trial::threads(sets)
        }
    }
}

/// The links of a cluster of nodes whose ranks share this machine's
/// cores (`scripts/cluster.sh`'s namespaces): measured by all-reducing
/// between two ranks of one node, and between two nodes of one rank each.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Network {
    /// Between two ranks of one node.
    pub intra: Link,
    /// Between two nodes, one rank on each: the node's whole link.
    pub node: Link,
    /// Seconds of the whole machine's cores per byte sent between the
    /// two nodes, measured while `node` was ([`Cluster::network_cpu`](crate::cluster::Cluster::network_cpu)).
    pub cpu_per_byte: f64,
}

impl Network {
    /// The best of several measurements: the highest bandwidths, the
    /// median latencies and cost to the cores (differences of timings and
    /// counts, which noise moves either way). `None` when `nets` is empty.
    #[must_use]
    pub fn best(nets: &[Network]) -> Option<Network> {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        if nets.is_empty() {
            return None;
        }
        let best = |f: fn(&Network) -> Link| Link {
            bandwidth: nets.iter().map(|n| f(n).bandwidth).fold(0.0, f64::max),
            latency: median(nets.iter().map(|n| f(n).latency).collect()),
        };
        Some(Network {
            intra: best(|n| n.intra),
            node: best(|n| n.node),
            cpu_per_byte: median(nets.iter().map(|n| n.cpu_per_byte).collect()),
        })
    }
}

/// What runs the layouts of a calibration.
pub trait Runner {
    /// A job's or a run's failure; the planner's errors convert into it.
    type Error: From<crate::Error>;
    /// The job `trial` makes of the base job, checked.
    ///
    /// # Errors
    /// The settings are wrong for the job.
    fn job(&mut self, trial: &Trial) -> Result<Job, Self::Error>;
    /// The links between and inside nodes, measured, when the runner runs
    /// jobs on nodes of their own network; `None` (the default) when
    /// every rank shares one machine's memory.
    ///
    /// # Errors
    /// The measurement failed.
    fn network(&mut self) -> Result<Option<Network>, Self::Error> {
        Ok(None)
    }
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
    /// The layouts ([`layouts`] on one machine, [`node_layouts`] on a
    /// cluster of nodes).
    pub layouts: Vec<Trial>,
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
    /// Ranks per node (0: one machine's thread ranks).
    pub per_node: usize,
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
/// tp=2, pp=2 (1F1B) on thread ranks, and one rank with full
/// recomputation (`train.recompute = "full"`).
#[must_use]
pub fn layouts() -> Vec<Trial> {
    [
        &[][..],
        &["parallel.dp=2"],
        &["parallel.dp=2", "parallel.fsdp=\"full\""],
        &["parallel.tp=2"],
        &["parallel.pp=2"],
        &["train.recompute=\"full\""],
    ]
    .into_iter()
    .map(Trial::threads)
    .collect()
}

/// The layouts `--calibrate` runs on a cluster of `nodes` nodes (2 or
/// more) of two ranks each: dp across two nodes (one rank each), FSDP
/// full and hybrid (shard inside a node, replicate across) over two nodes
/// of two ranks, pp across two nodes, tp inside a node with dp across;
/// then the communication crossover, pure FSDP at one rank per node over
/// 1, 2, 4 … nodes (up to `nodes`) at the job's global batch.
#[must_use]
pub fn node_layouts(nodes: usize) -> Vec<Trial> {
    let mut trials = vec![
        Trial::nodes(&["parallel.dp=2"], 1),
        Trial::nodes(&["parallel.dp=4", "parallel.fsdp=\"full\""], 2),
        Trial::nodes(
            &[
                "parallel.dp=4",
                "parallel.fsdp=\"hybrid\"",
                "parallel.hybrid_shard=2",
            ],
            2,
        ),
        Trial::nodes(&["parallel.pp=2"], 1),
        Trial::nodes(&["parallel.tp=2", "parallel.dp=2"], 2),
    ];
    let mut n = 1;
    while n <= nodes {
        let dp = format!("parallel.dp={n}");
        let mut t = Trial::nodes(&[&dp, "parallel.fsdp=\"full\""], 1);
        if n == 1 {
            t.sets[1] = "parallel.fsdp=\"none\"".into();
        }
        t.crossover = true;
        trials.push(t);
        n *= 2;
    }
    trials
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
    /// The links of the cluster of nodes the layouts ran on (the best of
    /// every round's measurement), where they ran on one.
    pub network: Option<Network>,
    /// Each layout, predicted from `machine` against its quietest round;
    /// the references (one rank, a pool of each size) first, flagged.
    pub layouts: Vec<CalibrationRow>,
    /// The communication crossover: pure FSDP at one rank per node over
    /// 1, 2, 4 … nodes at one global batch, predicted against measured.
    pub crossover: Vec<CrossoverRow>,
}

/// One node count of the communication crossover.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CrossoverRow {
    /// Nodes (one rank each).
    pub nodes: usize,
    /// Predicted seconds per step of compute (and everything but FSDP's
    /// exposed communication).
    pub predicted_compute_s: f64,
    /// Predicted seconds per step of exposed communication.
    pub predicted_exposed_s: f64,
    /// Measured: the step less the exposed communication.
    pub measured_compute_s: f64,
    /// Measured seconds per step the training thread waited on FSDP's
    /// collectives (0 on one node).
    pub measured_exposed_s: f64,
}

impl CrossoverRow {
    /// Exposed communication over compute, predicted.
    #[must_use]
    pub fn predicted_ratio(&self) -> f64 {
        self.predicted_exposed_s / self.predicted_compute_s
    }
    /// Exposed communication over compute, measured.
    #[must_use]
    pub fn measured_ratio(&self) -> f64 {
        self.measured_exposed_s / self.measured_compute_s
    }
}

/// The node count where exposed communication overtakes compute, from
/// `(nodes, exposed/compute)` pairs in order: linear in the node count
/// between the last point below 1 and the first at or above; `None` when
/// no point reaches 1.
#[must_use]
pub fn crossover_nodes(points: &[(usize, f64)]) -> Option<f64> {
    let i = points.iter().position(|p| p.1 >= 1.0)?;
    if i == 0 {
        return Some(points[0].0 as f64);
    }
    let ((n0, r0), (n1, r1)) = (points[i - 1], points[i]);
    let (n0, n1) = (n0 as f64, n1 as f64);
    Some(n0 + (1.0 - r0) / (r1 - r0) * (n1 - n0))
}

/// A pool size's step efficiency ([`Calibration::efficiency`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolEfficiency {
    /// Kernel threads of the pool.
    pub threads: usize,
    /// The share of the measured rates a step reaches.
    pub efficiency: f64,
}

/// A one-rank job with pools of `threads` threads: the reference of that
/// pool size (on a node of its own when `nodes`).
fn reference(threads: usize, nodes: bool) -> Trial {
    let mut t = Trial::nodes(
        &[
            "parallel.dp=1",
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.ep=1",
            "parallel.fsdp=\"none\"",
            "parallel.sequence_parallel=false",
        ],
        usize::from(nodes),
    );
    t.sets.push(format!("parallel.threads={threads}"));
    t
}

/// A job, whether it is its pool's reference, and whether it is part of
/// the crossover.
struct Entry {
    job: Job,
    reference: bool,
    crossover: bool,
}

/// The plan's layouts and a one-rank reference for each pool size they
/// have (a layout itself where one runs on one rank), references first;
/// and the pool sizes.
fn entries<R: Runner>(runner: &mut R, plan: &Plan) -> Result<(Vec<Entry>, Vec<usize>), R::Error> {
    let mut jobs = Vec::with_capacity(plan.layouts.len() + 2);
    for trial in &plan.layouts {
        jobs.push(Entry {
            job: runner.job(trial)?,
            reference: false,
            crossover: trial.crossover,
        });
    }
    let nodes = plan.layouts.iter().any(|t| t.per_node > 0);
    let mut pools: Vec<usize> = jobs.iter().map(|e| e.job.threads).collect();
    pools.sort_unstable();
    pools.dedup();
    for &t in &pools {
        if let Some(e) = jobs
            .iter_mut()
            .find(|e| e.job.layout.world() == 1 && e.job.threads == t && !e.crossover)
        {
            e.reference = true;
        } else {
            jobs.push(Entry {
                job: runner.job(&reference(t, nodes))?,
                reference: true,
                crossover: false,
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
    let mut nets = Vec::with_capacity(rounds);
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
        if let Some(net) = runner.network()? {
            say(&format!(
                "calibrate     round {round}/{rounds}: links: between nodes {:.1} MB/s + {:.0} µs ({:.1} ns of the machine a byte), in a node {:.1} MB/s + {:.0} µs",
                net.node.bandwidth / 1e6,
                net.node.latency * 1e6,
                net.cpu_per_byte * 1e9,
                net.intra.bandwidth / 1e6,
                net.intra.latency * 1e6
            ));
            nets.push(net);
        }
    }
    let machine = MachineProfile::best(&profiles).expect("at least one round");
    let network = Network::best(&nets);
    let request = |j: &Job, efficiency: f64| Request {
        model: plan.model.clone(),
        batch: j.batch,
        cluster: match network {
            Some(net) if j.per_node > 0 => {
                machine.cluster_on_nodes(j.layout.world(), j.per_node, j.threads, efficiency, &net)
            }
            _ => machine.cluster_at(j.layout.world(), j.threads, efficiency),
        },
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
    let mut crossover = Vec::new();
    for (e, measured) in jobs.iter().zip(measured) {
        let j = &e.job;
        let eff = efficiency
            .iter()
            .find(|p| p.threads == j.threads)
            .map_or(1.0, |p| p.efficiency);
        let predicted = predict(&request(j, eff), &j.layout)?;
        if e.crossover {
            let exposed = measured.fsdp.map_or(0.0, |f| f.exposed_s);
            crossover.push(CrossoverRow {
                nodes: j.layout.world(),
                // the cores' part of the network slows the compute: a
                // trace counts it there
                predicted_compute_s: predicted.step_s - predicted.time.dp_exposed
                    + predicted.time.dp_cores,
                predicted_exposed_s: predicted.time.dp_exposed - predicted.time.dp_cores,
                measured_compute_s: measured.step_s - exposed,
                measured_exposed_s: exposed,
            });
        }
        let total = measured.memory.total() as f64;
        rows.push(CalibrationRow {
            sets: j.sets.clone(),
            threads: j.threads,
            per_node: j.per_node,
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
        network,
        layouts: rows,
        crossover,
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
         {}\
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
        cal.network.map_or_else(String::new, |n| format!(
            "links of the cluster of nodes (best of every round; ranks on nodes share this machine's cores): \
             between two nodes {:.1} MB/s + {:.0} µs, each byte between nodes {:.2} ns of the machine's cores; \
             between two ranks of a node {:.1} MB/s + {:.0} µs\n\n",
            n.node.bandwidth / 1e6,
            n.node.latency * 1e6,
            n.cpu_per_byte * 1e9,
            n.intra.bandwidth / 1e6,
            n.intra.latency * 1e6
        )),
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
            "| {}{}{} | {} | {:.2} ms | {:.2} ms | {:+.1}% | {:.2} ms | {:+.1}% | {} ms | {} | {} | {:+.2}% |\n",
            r.predicted.layout,
            match r.per_node {
                0 => String::new(),
                p => format!(
                    " on {} node{}",
                    r.predicted.layout.world().div_ceil(p),
                    if r.predicted.layout.world() > p { "s" } else { "" }
                ),
            },
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
    if !cal.crossover.is_empty() {
        s.push_str(
            "\ncommunication crossover (pure FSDP, one rank per node, one global batch): \
             exposed communication against compute per step\n\n\
             | nodes | predicted compute | predicted exposed | predicted ratio | measured compute | measured exposed | measured ratio |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for r in &cal.crossover {
            s.push_str(&format!(
                "| {} | {:.1} ms | {:.1} ms | {:.2} | {:.1} ms | {:.1} ms | {:.2} |\n",
                r.nodes,
                1e3 * r.predicted_compute_s,
                1e3 * r.predicted_exposed_s,
                r.predicted_ratio(),
                1e3 * r.measured_compute_s,
                1e3 * r.measured_exposed_s,
                r.measured_ratio()
            ));
        }
        let at = |f: fn(&CrossoverRow) -> f64| {
            let pts: Vec<(usize, f64)> = cal.crossover.iter().map(|r| (r.nodes, f(r))).collect();
            crossover_nodes(&pts).map_or_else(
                || format!("beyond {} nodes", pts.last().map_or(0, |p| p.0)),
                |n| format!("at {n:.1} nodes"),
            )
        };
        s.push_str(&format!(
            "\nexposed communication overtakes compute: predicted {}, measured {}\n",
            at(CrossoverRow::predicted_ratio),
            at(CrossoverRow::measured_ratio)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The crossover interpolates linearly between the points around 1.
    #[test]
    fn crossover_interpolates_between_the_points_around_one() {
        assert_eq!(crossover_nodes(&[(1, 0.0), (2, 0.5), (4, 1.5)]), Some(3.0));
        assert_eq!(crossover_nodes(&[(1, 0.0), (2, 0.4)]), None);
        assert_eq!(crossover_nodes(&[(1, 1.2), (2, 2.0)]), Some(1.0));
        assert_eq!(crossover_nodes(&[]), None);
    }

    /// The network's best takes the highest bandwidth and the median
    /// latency of each link, and the median cost to the cores.
    #[test]
    fn network_best_takes_bandwidth_s_best_and_latency_s_median() {
        let net = |b: f64, a: f64| Network {
            cpu_per_byte: a * 1e-9,
            intra: Link {
                bandwidth: 10.0 * b,
                latency: a,
            },
            node: Link {
                bandwidth: b,
                latency: 2.0 * a,
            },
        };
        let best = Network::best(&[net(1.0, 5.0), net(3.0, 1.0), net(2.0, 9.0)]).unwrap();
        assert_eq!(best.node.bandwidth, 3.0);
        assert_eq!(best.intra.bandwidth, 30.0);
        assert_eq!(best.node.latency, 10.0);
        assert_eq!(best.intra.latency, 5.0);
        assert_eq!(best.cpu_per_byte, 5e-9);
        assert!(Network::best(&[]).is_none());
    }
}
