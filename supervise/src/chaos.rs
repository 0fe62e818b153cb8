//! `weft chaos`: a drill of the survival kit. Runs a small job once
//! fault-free, then `trials` times under `weft train --supervise` with
//! one fault each, drawn from a seeded generator (a killed or hung rank,
//! gradients made non-finite, a garbage batch, a checkpoint that rots
//! before a kill, a crash while saving; on a cluster of namespaces also a
//! node that dies and a link that flaps), and reports per trial whether the
//! fault was detected (and how long after it fired), whether the run
//! recovered, the restarts and rewinds it took, the steps and seconds it
//! lost, the restart's cost, and whether its final state — every step's
//! loss and the last checkpoint's bytes — is bitwise the fault-free run's
//! (after a rewind: the fault-free run given the same skip list, which is
//! what a rewind promises).
//!
//! Every job is a child process of the `weft` binary given; a trial that
//! outlives its limit is killed and counted as hung.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use weft_trace::{EventKind, MetricsEvent, MetricsEventKind, MetricsRecord};

use crate::cluster::{DrillCluster, NodeFault, NodeFaultKind, last_step};
use crate::events::read_events;
use crate::fault::{Fault, FaultKind};

/// The kinds of fault a drill draws, by the names `--faults` takes: the
/// job's own (injected with `--inject`) and, on a cluster, the nodes'.
pub const DRILL_FAULTS: [&str; 8] = [
    "kill",
    "hang",
    "nan",
    "spike",
    "corrupt-checkpoint",
    "crash-during-save",
    "node-kill",
    "link-flap",
];

/// The least heartbeat timeout of a drill on a cluster (see
/// [`Drill::cluster`]).
const CLUSTER_HEARTBEAT: Duration = Duration::from_secs(30);

/// A trial's fault: injected into the job, or done to a node.
#[derive(Clone, Debug, PartialEq)]
enum Planned {
    /// `--inject` faults (a rotten checkpoint comes with the kill that
    /// makes the run need it).
    Inject(Vec<Fault>),
    /// A node's or a link's fault, done by the drill.
    Node(NodeFault),
}

impl std::fmt::Display for Planned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Planned::Inject(faults) => {
                let names: Vec<String> = faults.iter().map(ToString::to_string).collect();
                f.write_str(&names.join(" + "))
            }
            Planned::Node(n) => n.fmt(f),
        }
    }
}

/// What a drill runs.
#[derive(Clone, Debug)]
pub struct Drill {
    /// The `weft` binary.
    pub weft: PathBuf,
    /// `--set` overrides of the job (after the drill's defaults, see
    /// [`Drill::job_sets`]).
    pub sets: Vec<String>,
    /// Where the runs go (a folder of its own: `reference`, `trial-N`).
    pub dir: PathBuf,
    /// Trials.
    pub trials: usize,
    /// Seed of the faults drawn.
    pub seed: u64,
    /// The supervisor's heartbeat timeout.
    pub heartbeat_timeout: Duration,
    /// A launcher for the job (`--launch`), empty for none.
    pub launch: Option<String>,
    /// What the faults are drawn against: the job's length, checkpoint
    /// interval, ranks and non-finite limit (the trainer reads them from
    /// the configuration [`Drill::job_sets`] make).
    pub job: DrillJob,
    /// The kinds drawn, by their [`DRILL_FAULTS`] names; empty: every kind
    /// that can happen (the nodes' only with a cluster). Each round of as
    /// many trials as kinds draws every kind once, in a seeded order.
    pub kinds: Vec<String>,
    /// A cluster of namespaces to run every job on (its hostfile, one node
    /// spare: `--spares 1`; a heartbeat timeout of at least 30 s, so the
    /// launcher names a lost node first), and to kill nodes and flap links
    /// of. [`Drill::launch`] must be its launch (see
    /// [`DrillCluster::launch`]).
    pub cluster: Option<DrillCluster>,
}

/// The settings of a drill's job that decide which faults can happen
/// where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrillJob {
    /// `train.steps`.
    pub steps: u64,
    /// `checkpoint.every`.
    pub every: u64,
    /// Ranks of the job.
    pub ranks: usize,
    /// `train.nonfinite_limit`: non-finite steps in a row that make a
    /// rewind.
    pub nonfinite_limit: u64,
}

/// One trial's outcome.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Trial {
    /// The fault injected.
    pub fault: String,
    /// Seconds from the fault firing to its detection (a failure or a
    /// rewind recorded), if detected.
    pub detected_after_s: Option<f64>,
    /// Whether the supervised run finished.
    pub recovered: bool,
    /// Whether the trial outlived its time limit and was killed.
    pub hung: bool,
    /// Restarts the supervisor made.
    pub restarts: usize,
    /// Rewinds the trainer made.
    pub rewinds: usize,
    /// Steps trained twice (lost to restarts and rewinds).
    pub lost_steps: u64,
    /// The trial's wall time minus the fault-free run's.
    pub time_lost_s: f64,
    /// Seconds from a failure to the restarted job training again, or
    /// from a rewind to the rewound run training again.
    pub restart_s: Option<f64>,
    /// Whether every step's loss and the last checkpoint's bytes equal
    /// the fault-free run's (given the trial's skip list).
    pub bitwise: bool,
}

/// A failure of the drill itself (not of a trial).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// A fault-free run failed.
    #[error("the fault-free run {run} failed: {message}")]
    Reference {
        /// Its folder.
        run: PathBuf,
        /// What it printed last.
        message: String,
    },
    /// The drill's job is too short for the faults it draws.
    #[error("the drill's job: {0}")]
    Job(String),
    /// The drill would replace runs already in its folder.
    #[error(
        "{0} already exists (an earlier drill's run?); the drill replaces no run: \
         remove it, or give another --dir"
    )]
    Exists(PathBuf),
    /// The cluster cannot hold the drill, or a node fault could not be
    /// done.
    #[error("{0}")]
    Cluster(String),
    /// A fault kind unknown, or not possible here.
    #[error("--faults: {0}")]
    Kinds(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A splitmix64 generator: the drill's faults from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// A run's final state: every step's loss and every validation loss (as
/// their bits), and a hash of the last checkpoint's rank files.
fn fingerprint(run: &Path) -> Option<(Vec<(u64, u64)>, u64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).ok()?;
    let losses: Vec<(u64, u64)> = text
        .lines()
        .filter_map(|l| {
            if let Ok(r) = serde_json::from_str::<MetricsRecord>(l) {
                return Some((r.step, r.loss.to_bits()));
            }
            match serde_json::from_str::<MetricsEvent>(l) {
                Ok(MetricsEvent {
                    step,
                    kind: MetricsEventKind::Eval { val_loss, .. },
                }) => Some((step, val_loss.to_bits())),
                _ => None,
            }
        })
        .collect();
    let ckpt =
        weft_checkpoint::load_latest(&run.join("checkpoints"), weft_checkpoint::VerifyLevel::Full)
            .ok()??;
    let mut files: Vec<PathBuf> = std::fs::read_dir(ckpt.checkpoint.dir())
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for f in files {
        h.update(&std::fs::read(f).ok()?);
    }
    Some((losses, h.digest()))
}

impl Drill {
    /// The drill's job: a small model on the synthetic corpus, 60 steps,
    /// checkpoints every 10, rewinds on, then [`Drill::sets`]. Its spike
    /// detector watches a window of 10 steps at 1.5× the median: so small
    /// a model is unsure even of garbage (a scrambled batch costs it about
    /// 1.9× the median loss past step 30), while its ordinary steps stay
    /// within 1.03× of it.
    #[must_use]
    pub fn job_sets(&self) -> Vec<String> {
        [
            "model.n_layer=1",
            "model.n_head=2",
            "model.n_embd=32",
            "model.block_size=32",
            "train.batch_size=8",
            "train.steps=60",
            "train.eval_every=30",
            "train.eval_sequences=16",
            "train.spike_window=10",
            "train.spike_factor=1.5",
            "train.rewind=true",
            "optim.warmup_steps=5",
            "optim.lr=1e-2",
            "data.synthetic.regular=40",
            "data.synthetic.successors=3",
            "checkpoint.every=10",
            "parallel.timeout_s=5",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .chain(self.sets.iter().cloned())
        .collect()
    }

    /// `weft train` of run `name` with `extra` arguments.
    fn train(&self, name: &str, extra: &[OsString]) -> Command {
        let mut c = Command::new(&self.weft);
        // a trial's supervisor stops (and stops its job) if the drill dies
        crate::die_with_parent(&mut c, libc::SIGTERM);
        c.arg("train");
        for s in self.job_sets() {
            c.arg("--set").arg(s);
        }
        c.arg("--set")
            .arg(format!("run.dir={:?}", self.dir.display().to_string()))
            .arg("--set")
            .arg(format!("run.name={name}"));
        if let Some(cluster) = &self.cluster {
            // the first nodes hold the job, the rest are spare
            c.arg("--hostfile").arg(cluster.hostfile());
        }
        c.args(extra).stdout(Stdio::null()).stderr(Stdio::piped());
        c
    }

    /// Runs a fault-free job, `skips` left out; its wall time.
    fn reference(&self, name: &str, skips: &[u64]) -> Result<f64, ChaosError> {
        let run = self.dir.join(name);
        let mut extra: Vec<OsString> = Vec::new();
        if !skips.is_empty() {
            let list: Vec<String> = skips.iter().map(u64::to_string).collect();
            extra.extend([
                "--set".into(),
                format!("train.skip_batches=[{}]", list.join(",")).into(),
            ]);
        }
        // supervised as the trials are, so their times compare
        extra.push("--supervise".into());
        if let Some(l) = &self.launch {
            extra.extend(["--launch".into(), l.into()]);
        }
        let t = Instant::now();
        let out = self
            .train(name, &extra)
            .output()
            .map_err(|source| ChaosError::Io {
                path: self.weft.clone(),
                source,
            })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(ChaosError::Reference {
                run,
                message: err.lines().last().unwrap_or("").to_owned(),
            });
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// The faults of a trial of kind `kind`: rank and step drawn from `rng` for a
    /// run of `steps` steps with checkpoints every `every`, `ranks` ranks
    /// and `limit` non-finite steps making a rewind. Spikes are drawn from
    /// the second half, where the loss has settled enough for a garbage
    /// batch to stand out against the rolling median. A rotten checkpoint
    /// is followed by a kill, which makes the run need it.
    fn draw(
        rng: &mut Rng,
        kind: FaultKind,
        steps: u64,
        every: u64,
        ranks: usize,
        limit: u64,
    ) -> Vec<Fault> {
        let rank = usize::try_from(rng.next() % ranks.max(1) as u64).unwrap_or(0);
        let fault = |kind, step| Fault {
            kind,
            step,
            rank,
            count: 1,
            factor: 2.0,
        };
        let saves = (steps - 1) / every; // checkpoints before the last step
        match kind {
            FaultKind::Nan => vec![Fault {
                count: limit,
                ..fault(kind, rng.range(2, steps - limit))
            }],
            FaultKind::Spike => vec![fault(kind, rng.range(steps / 2, steps))],
            FaultKind::CorruptCheckpoint => {
                let at = every * rng.range(1, saves.max(1));
                vec![
                    Fault {
                        rank: 0,
                        ..fault(kind, at)
                    },
                    fault(FaultKind::Kill, rng.range(at + 1, (at + every).min(steps))),
                ]
            }
            FaultKind::CrashDuringSave => vec![fault(kind, every * rng.range(1, saves.max(1)))],
            _ => vec![fault(kind, rng.range(2, steps))],
        }
    }

    /// The kinds the drill draws: [`Drill::kinds`], checked, or every
    /// kind that can happen.
    fn kinds(&self) -> Result<Vec<&'static str>, ChaosError> {
        let node_kinds = [
            NodeFaultKind::NodeKill.name(),
            NodeFaultKind::LinkFlap.name(),
        ];
        if self.kinds.is_empty() {
            return Ok(DRILL_FAULTS
                .iter()
                .copied()
                .filter(|k| self.cluster.is_some() || !node_kinds.contains(k))
                .collect());
        }
        let mut out = Vec::new();
        for k in &self.kinds {
            let Some(&known) = DRILL_FAULTS.iter().find(|d| *d == k) else {
                return Err(ChaosError::Kinds(format!(
                    "'{k}' is no fault kind (kinds: {})",
                    DRILL_FAULTS.join(", ")
                )));
            };
            if node_kinds.contains(&known) && self.cluster.is_none() {
                return Err(ChaosError::Kinds(format!(
                    "'{k}' needs a cluster of nodes (--cluster NAME, made by scripts/cluster.sh up)"
                )));
            }
            if !out.contains(&known) {
                out.push(known);
            }
        }
        Ok(out)
    }

    /// A node fault of kind `kind` (a [`NodeFaultKind`] name): one of the
    /// `busy` nodes that hold the job, from step 2 to the middle of the
    /// run (the drill sees steps as they are logged; a fault late in a
    /// fast job could miss it), a flap of 30 to 40 seconds: longer than
    /// the drill's `parallel.timeout_s`, so the attempt fails, and than
    /// the launcher's teardown and the supervisor's probes after it, so
    /// the flapped node is still silent when the supervisor asks which
    /// node failed (a flap of 16 s healed during the probes, and the
    /// survivor that reported the failure was blamed).
    fn draw_node(&self, rng: &mut Rng, kind: &str, steps: u64, busy: usize) -> NodeFault {
        let kind = if kind == NodeFaultKind::NodeKill.name() {
            NodeFaultKind::NodeKill
        } else {
            NodeFaultKind::LinkFlap
        };
        let nodes = self.cluster.as_ref().map_or(&[][..], |c| &c.nodes[..]);
        let i = usize::try_from(rng.next() % busy.max(1) as u64).unwrap_or(0);
        NodeFault {
            kind,
            node: nodes.get(i).map_or_else(|| "n0".into(), |n| n.0.clone()),
            step: rng.range(2, (steps / 2).max(2)),
            seconds: rng.range(30, 40),
        }
    }

    /// Runs the drill, reporting each trial to `each` as it ends.
    ///
    /// # Errors
    /// [`ChaosError`] when a fault-free run fails or a folder cannot be
    /// made.
    pub fn run(&self, mut each: impl FnMut(usize, &Trial)) -> Result<Vec<Trial>, ChaosError> {
        // every fault needs room: two checkpoints before the last step (a
        // rotten one and the one before it), and a rewind's steps
        let j = &self.job;
        if j.every == 0 || j.steps <= 2 * j.every {
            return Err(ChaosError::Job(format!(
                "train.steps = {} with checkpoint.every = {}: the drill needs two \
                 checkpoints before the last step (train.steps > 2 x checkpoint.every)",
                j.steps, j.every
            )));
        }
        if j.steps < j.nonfinite_limit + 4 {
            return Err(ChaosError::Job(format!(
                "train.steps = {} leaves no room for train.nonfinite_limit = {} non-finite \
                 steps (train.steps >= nonfinite_limit + 4)",
                j.steps, j.nonfinite_limit
            )));
        }
        let kinds = self.kinds()?;
        let busy = match &self.cluster {
            Some(c) => c.busy_nodes(self.job.ranks)?,
            None => 0,
        };
        std::fs::create_dir_all(&self.dir).map_err(|source| ChaosError::Io {
            path: self.dir.clone(),
            source,
        })?;
        // the runs it writes must be new: it never deletes a user's folder
        for entry in std::fs::read_dir(&self.dir).map_err(|source| ChaosError::Io {
            path: self.dir.clone(),
            source,
        })? {
            let name = entry
                .map_err(|source| ChaosError::Io {
                    path: self.dir.clone(),
                    source,
                })?
                .file_name();
            let name = name.to_string_lossy();
            if name == "reference" || name.starts_with("reference-") || name.starts_with("trial-") {
                return Err(ChaosError::Exists(self.dir.join(&*name)));
            }
        }
        let reference_s = self.reference("reference", &[])?;
        let clean = fingerprint(&self.dir.join("reference"));
        let mut rng = Rng(self.seed);
        let DrillJob {
            steps,
            every,
            ranks,
            nonfinite_limit,
        } = self.job;
        let every = every.max(1);
        let limit = reference_s * 10.0 + 60.0 + self.heartbeat_timeout.as_secs_f64() * 3.0;
        let mut trials = Vec::new();
        let mut deck: Vec<&str> = Vec::new();
        for i in 0..self.trials {
            if deck.is_empty() {
                // a round: every kind once, in a seeded order
                deck.clone_from(&kinds);
                for k in (1..deck.len()).rev() {
                    let j = usize::try_from(rng.next() % (k as u64 + 1)).unwrap_or(0);
                    deck.swap(k, j);
                }
            }
            let kind = deck.pop().unwrap_or("kill");
            let planned = match FaultKind::ALL.iter().find(|(_, n)| *n == kind) {
                Some(&(k, _)) => Planned::Inject(Self::draw(
                    &mut rng,
                    k,
                    steps,
                    every,
                    ranks,
                    nonfinite_limit,
                )),
                None => Planned::Node(self.draw_node(&mut rng, kind, steps, busy)),
            };
            let faults = match &planned {
                Planned::Inject(f) => f.clone(),
                Planned::Node(_) => Vec::new(),
            };
            let name = format!("trial-{i}");
            let run = self.dir.join(&name);
            // on a cluster, a node lost is named by mpirun (about 6 s) or
            // the collectives' timeout (parallel.timeout_s) before the
            // heartbeats would name no one, and its spare node takes over
            let heartbeat = match &self.cluster {
                Some(_) => self.heartbeat_timeout.max(CLUSTER_HEARTBEAT),
                None => self.heartbeat_timeout,
            };
            let mut extra: Vec<OsString> = vec![
                "--supervise".into(),
                "--restart-backoff".into(),
                "0.1".into(),
                "--heartbeat-timeout".into(),
                heartbeat.as_secs_f64().to_string().into(),
            ];
            if self.cluster.is_some() {
                extra.extend(["--spares".into(), "1".into()]);
            }
            if let Some(l) = &self.launch {
                extra.extend(["--launch".into(), l.into()]);
            }
            for f in &faults {
                extra.extend(["--inject".into(), f.to_string().into()]);
            }
            let t = Instant::now();
            // the trial's output is kept beside its run folder
            let log = self.dir.join(format!("{name}.log"));
            let log = std::fs::File::create(&log).map_err(|source| ChaosError::Io {
                path: log.clone(),
                source,
            })?;
            let mut child = self
                .train(&name, &extra)
                .stderr(log)
                .spawn()
                .map_err(|source| ChaosError::Io {
                    path: self.weft.clone(),
                    source,
                })?;
            let (mut status, mut hung) = (None, false);
            let mut node = NodeState::new(&planned);
            while status.is_none() {
                status = child.try_wait().ok().flatten();
                if status.is_none() && t.elapsed().as_secs_f64() > limit {
                    let _ = child.kill();
                    status = child.wait().ok();
                    hung = true;
                }
                if let (Some(c), Planned::Node(f)) = (&self.cluster, &planned) {
                    node.advance(c, f, &run)?;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if let (Some(c), Planned::Node(f)) = (&self.cluster, &planned) {
                // the node whole again for the next trial
                node.restore(c, f)?;
            }
            let wall = t.elapsed().as_secs_f64();
            let ev = read_events(&run);
            let at = |name: &'static str| ev.iter().filter(move |e| e.kind.name() == name);
            let times = |name: &'static str| at(name).map(|e| e.time);
            // detected: each fault by what answers it — a failure after a
            // kill, hang or crash, a rewind after bad data, a restart that
            // passed over the rotten checkpoint — timed from the last
            // fault fired to the first answer after it
            let fired: Vec<f64> = match &planned {
                Planned::Inject(_) => times("fault").collect(),
                Planned::Node(_) => node.fired.into_iter().collect(),
            };
            let needed = match &planned {
                Planned::Inject(f) => f.len(),
                Planned::Node(_) => 1,
            };
            let answered = |kind: FaultKind| {
                match kind {
                FaultKind::Nan | FaultKind::Spike => at("rewind").next().is_some(),
                FaultKind::CorruptCheckpoint => ev.iter().any(|e| {
                    matches!(&e.kind, EventKind::Restart { unverified_checkpoints, .. } if !unverified_checkpoints.is_empty())
                }),
                _ => at("failure").next().is_some(),
            }
            };
            let detected_after_s = fired
                .iter()
                .copied()
                .reduce(f64::max)
                .filter(|_| fired.len() >= needed)
                .filter(|_| faults.iter().all(|f| answered(f.kind)))
                .filter(|_| matches!(planned, Planned::Inject(_)) || at("failure").next().is_some())
                .and_then(|last| {
                    times("failure")
                        .chain(times("rewind"))
                        .filter(|&t| t >= last)
                        .reduce(f64::min)
                        .map(|t| t - last)
                });
            // a restart's cost: from the failure to training again (a
            // rewind's: from the rewind to training again)
            let restart_s = times("failure")
                .chain(times("rewind"))
                .reduce(f64::min)
                .and_then(|f| {
                    times("running")
                        .chain(times("rewound"))
                        .filter(|&r| r > f)
                        .reduce(f64::min)
                        .map(|r| r - f)
                });
            let (mut lost_steps, mut skips) = (0u64, Vec::new());
            for e in &ev {
                match &e.kind {
                    EventKind::Restart { lost_steps: l, .. } => lost_steps += l,
                    EventKind::Rewind {
                        step,
                        to_step,
                        skipped_batches,
                        ..
                    } => {
                        lost_steps += step.saturating_sub(*to_step);
                        skips.extend(skipped_batches);
                    }
                    _ => {}
                }
            }
            let recovered =
                !hung && status.is_some_and(|s| s.success()) && at("finished").next().is_some();
            let expected = if skips.is_empty() {
                clean.clone()
            } else {
                let name = format!("reference-{i}");
                self.reference(&name, &skips)?;
                fingerprint(&self.dir.join(name))
            };
            let got = fingerprint(&run);
            let trial = Trial {
                fault: planned.to_string(),
                detected_after_s,
                recovered,
                hung,
                restarts: at("restart").count(),
                rewinds: at("rewind").count(),
                lost_steps,
                time_lost_s: wall - reference_s,
                restart_s,
                bitwise: recovered && got.is_some() && got == expected,
            };
            each(i, &trial);
            trials.push(trial);
        }
        Ok(trials)
    }
}

/// Where a trial's node fault stands.
struct NodeState {
    /// When it was done (seconds since the Unix epoch, as events are).
    fired: Option<f64>,
    /// A flapped link's time to come back up.
    up_at: Option<Instant>,
    /// Whether there is nothing left to do.
    done: bool,
}

impl NodeState {
    fn new(planned: &Planned) -> Self {
        NodeState {
            fired: None,
            up_at: None,
            done: !matches!(planned, Planned::Node(_)),
        }
    }

    /// Does the fault once `run` is past its step; brings a flapped link
    /// back up when its time is over.
    fn advance(&mut self, c: &DrillCluster, f: &NodeFault, run: &Path) -> Result<(), ChaosError> {
        if self.done {
            return Ok(());
        }
        if self.fired.is_none() {
            if last_step(run).is_some_and(|s| s >= f.step) {
                let args: &[&str] = match f.kind {
                    NodeFaultKind::NodeKill => &["kill-node", &f.node],
                    NodeFaultKind::LinkFlap => &["link", &f.node, "down"],
                };
                c.run(args)?;
                self.fired = Some(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                );
                match f.kind {
                    NodeFaultKind::NodeKill => self.done = true,
                    NodeFaultKind::LinkFlap => {
                        self.up_at = Some(Instant::now() + Duration::from_secs(f.seconds));
                    }
                }
            }
        } else if self.up_at.is_some_and(|t| Instant::now() >= t) {
            c.run(&["link", &f.node, "up"])?;
            self.up_at = None;
            self.done = true;
        }
        Ok(())
    }

    /// After the trial: a killed node revived, a link still down brought
    /// up.
    fn restore(&mut self, c: &DrillCluster, f: &NodeFault) -> Result<(), ChaosError> {
        if self.up_at.take().is_some() {
            c.run(&["link", &f.node, "up"])?;
        }
        if self.fired.is_some() && f.kind == NodeFaultKind::NodeKill {
            c.run(&["revive", &f.node])?;
        }
        Ok(())
    }
}

/// The drill's table: a header, one line per trial, and the totals
/// (detected, recovered, hung, bitwise, the mean restart cost and the
/// worst time lost against the checkpoint interval plus a restart).
#[must_use]
pub fn table_header() -> String {
    format!(
        "{:>5}  {:<48} {:>9} {:>10} {:>9} {:>8} {:>7} {:>5} {:>10} {:>10} {:>8}",
        "trial",
        "fault",
        "detected",
        "after (s)",
        "recovered",
        "restarts",
        "rewinds",
        "lost",
        "lost (s)",
        "restart(s)",
        "bitwise"
    )
}

/// One trial's line of the table.
#[must_use]
pub fn table_row(i: usize, t: &Trial) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let secs = |s: Option<f64>| s.map_or_else(|| "-".into(), |s| format!("{s:.2}"));
    format!(
        "{:>5}  {:<48} {:>9} {:>10} {:>9} {:>8} {:>7} {:>5} {:>10.2} {:>10} {:>8}",
        i,
        t.fault,
        yes(t.detected_after_s.is_some()),
        secs(t.detected_after_s),
        if t.hung { "HUNG" } else { yes(t.recovered) },
        t.restarts,
        t.rewinds,
        t.lost_steps,
        t.time_lost_s,
        secs(t.restart_s),
        yes(t.bitwise),
    )
}

/// The totals under the table: detected, recovered, hung and bitwise
/// counts, the mean restart cost, and the worst time a trial lost beyond
/// its fault's detection and its restarts, against the checkpoint
/// interval (`every` steps of `step_s` seconds) — the most a restart from
/// the newest checkpoint can lose.
#[must_use]
pub fn table_totals(trials: &[Trial], step_s: f64, every: u64) -> String {
    let n = trials.len();
    let count = |f: &dyn Fn(&Trial) -> bool| trials.iter().filter(|t| f(t)).count();
    let restarts: Vec<f64> = trials.iter().filter_map(|t| t.restart_s).collect();
    #[allow(clippy::cast_precision_loss)]
    let mean_restart = if restarts.is_empty() {
        0.0
    } else {
        restarts.iter().sum::<f64>() / restarts.len() as f64
    };
    // beyond detection, each restart's cost and its backoff (0.1 s)
    let excess = trials
        .iter()
        .map(|t| {
            #[allow(clippy::cast_precision_loss)]
            let backoff = 0.1 * t.restarts as f64;
            t.time_lost_s - t.detected_after_s.unwrap_or(0.0) - t.restart_s.unwrap_or(0.0) - backoff
        })
        .fold(0.0, f64::max);
    #[allow(clippy::cast_precision_loss)]
    let interval = every as f64 * step_s;
    format!(
        "detected {}/{n}, recovered {}/{n}, hung {}, bitwise {}/{n}; restart cost {mean_restart:.2} s (mean, process start to training again); \
         worst time lost beyond detection and restart {excess:.2} s, checkpoint interval {interval:.2} s",
        count(&|t| t.detected_after_s.is_some()),
        count(&|t| t.recovered),
        count(&|t| t.hung),
        count(&|t| t.bitwise),
    )
}

#[cfg(test)]
mod tests {
    use super::{Drill, FaultKind, Rng};

    #[test]
    fn the_drill_draws_every_kind_of_fault_where_it_can_happen() {
        let mut rng = Rng(7);
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..400 {
            let kind = FaultKind::ALL[[0, 1, 2, 3, 5, 6][i % 6]].0;
            let faults = Drill::draw(&mut rng, kind, 60, 10, 2, 3);
            let f = faults[0];
            seen.insert(f.kind.name());
            assert!(f.rank < 2);
            assert!((1..=60).contains(&f.step), "{f}");
            match f.kind {
                FaultKind::CorruptCheckpoint => {
                    assert!(f.step.is_multiple_of(10));
                    assert!(f.step < 60);
                    let kill = faults[1];
                    assert_eq!(kill.kind, FaultKind::Kill);
                    assert!(kill.step > f.step && kill.step <= f.step + 10, "{kill}");
                }
                FaultKind::CrashDuringSave => assert!(f.step.is_multiple_of(10) && f.step < 60),
                FaultKind::Nan => assert!(f.step + f.count - 1 <= 60 && f.count == 3),
                FaultKind::Spike => assert!(f.step >= 30),
                _ => assert!(f.step >= 2),
            }
        }
        assert_eq!(seen.len(), 6, "{seen:?}");
    }
}
