//! Supervision: run a job as a child process, watch it, and restart it
//! from its newest checkpoint that verifies when it fails — with no person
//! awake — plus the faults to drill it with.
//!
//! `weft train --supervise` runs the same `weft train` as a child. The
//! child's rank 0 writes a heartbeat (`<run>/heartbeat`: the last step
//! done) at the start and after every step. The supervisor restarts the
//! child, with `--resume`, when it exits with an error or is killed, or
//! when its heartbeat stops for longer than the heartbeat timeout (then it
//! kills it first). Restarts are bounded (`max_restarts`) and spaced by a
//! backoff that doubles from `backoff`. Each start, failure, restart and
//! the end are appended to `<run>/events.jsonl`: when, which attempt, what
//! failed, the checkpoint resumed from and the steps lost.
//!
//! A child stopped by a signal the supervisor forwarded (Ctrl-C: the run
//! saves and stops, see [`crate::stop`]) is not restarted.
//!
//! [`Fault`]s (`--inject kill:rank=1,step=37`, `hang:step=50`,
//! `nan:step=60`, `spike:step=45`, `slow:rank=1,factor=3`,
//! `corrupt-checkpoint:step=40`, `crash-during-save:step=80`) are for
//! tests and drills: the supervisor passes them to the first attempt only,
//! so a restarted run goes on fault-free.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What a [`Fault`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank's process is killed (SIGKILL, as by the OOM killer or a
    /// lost node) as the step begins.
    Kill,
    /// The rank stops making progress as the step begins (a rank stuck in
    /// a kernel): only a heartbeat or the collectives' watchdog notices.
    Hang,
    /// The batches of `count` steps from the step (as a fault-free run
    /// reads them) make the gradients non-finite (a parameter reads NaN
    /// while they are trained on, as an overflowing kernel makes it): the
    /// updates are skipped. Every rank's.
    Nan,
    /// The batch the step reads in a fault-free run is garbage (its
    /// targets scrambled, as by a corrupt shard of the corpus): the loss
    /// spikes. Every rank's.
    Spike,
    /// The rank computes `factor` times slower from the step on (a
    /// throttled chip, a noisy neighbour): a straggler.
    Slow,
    /// After the checkpoint of the step is committed, one of its files has
    /// a byte flipped (bit rot, a torn copy): loading it must fail and
    /// fall back.
    CorruptCheckpoint,
    /// The rank's process is killed while the checkpoint of the step is
    /// being written, after its own file and before the commit.
    CrashDuringSave,
}

impl FaultKind {
    const ALL: [(FaultKind, &'static str); 7] = [
        (FaultKind::Kill, "kill"),
        (FaultKind::Hang, "hang"),
        (FaultKind::Nan, "nan"),
        (FaultKind::Spike, "spike"),
        (FaultKind::Slow, "slow"),
        (FaultKind::CorruptCheckpoint, "corrupt-checkpoint"),
        (FaultKind::CrashDuringSave, "crash-during-save"),
    ];

    /// The name `--inject` uses.
    #[must_use]
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(k, _)| *k == self)
            .map_or("?", |(_, n)| n)
    }
}

/// A fault injected into a run for tests and drills:
/// `KIND:step=N[,rank=R][,count=C][,factor=F]`, for example
/// `kill:rank=1,step=37`, `hang:step=50`, `nan:step=60,count=3`,
/// `spike:step=45`, `slow:rank=1,factor=3`, `corrupt-checkpoint:step=40`,
/// `crash-during-save:step=80`. Steps are 1-based; `rank` (default 0) is
/// the world rank that suffers it (`nan` and `spike` are faults of the
/// data, every rank's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The step (1-based) it happens at (from, for `slow`).
    pub step: u64,
    /// The world rank it happens on.
    pub rank: usize,
    /// Consecutive steps (`nan`).
    pub count: u64,
    /// How many times slower (`slow`).
    pub factor: f64,
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let kinds: Vec<&str> = FaultKind::ALL.iter().map(|(_, n)| *n).collect();
        let usage = format!(
            "expected KIND:step=N[,rank=R][,count=C][,factor=F] with KIND one of {}",
            kinds.join(", ")
        );
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        let kind = FaultKind::ALL
            .iter()
            .find(|(_, n)| *n == kind)
            .map(|(k, _)| *k)
            .ok_or_else(|| format!("--inject {s:?}: unknown fault {kind:?}; {usage}"))?;
        let mut fault = Fault {
            kind,
            step: 0,
            rank: 0,
            count: 1,
            factor: 2.0,
        };
        for field in rest.split(',').filter(|f| !f.is_empty()) {
            let (key, value) = field
                .split_once('=')
                .ok_or_else(|| format!("--inject {s:?}: {field:?} is not KEY=VALUE; {usage}"))?;
            let bad = |what: &str| format!("--inject {s:?}: {key}={value:?} is not {what}");
            match key {
                "step" => {
                    fault.step = value
                        .parse()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad("a step ≥ 1"))?;
                }
                "rank" => fault.rank = value.parse().map_err(|_| bad("a rank ≥ 0"))?,
                "count" if kind == FaultKind::Nan => {
                    fault.count = value
                        .parse()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad("a count ≥ 1"))?;
                }
                "factor" if kind == FaultKind::Slow => {
                    fault.factor = value
                        .parse()
                        .ok()
                        .filter(|f: &f64| f.is_finite() && *f >= 1.0)
                        .ok_or_else(|| bad("a factor ≥ 1"))?;
                }
                _ => {
                    return Err(format!(
                        "--inject {s:?}: {key:?} is not a setting of {}; {usage}",
                        kind.name()
                    ));
                }
            }
        }
        if fault.step == 0 {
            if kind == FaultKind::Slow {
                fault.step = 1;
            } else {
                return Err(format!("--inject {s:?}: step=N is missing; {usage}"));
            }
        }
        Ok(fault)
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:step={}", self.kind.name(), self.step)?;
        if self.rank != 0 {
            write!(f, ",rank={}", self.rank)?;
        }
        if self.kind == FaultKind::Nan && self.count != 1 {
            write!(f, ",count={}", self.count)?;
        }
        if self.kind == FaultKind::Slow {
            write!(f, ",factor={}", self.factor)?;
        }
        Ok(())
    }
}

/// The faults armed in this process, each with whether it has fired.
static FAULTS: Mutex<Vec<(Fault, bool)>> = Mutex::new(Vec::new());

/// Arms `faults` for the runs of this process. Each fires once (a `nan`
/// over its `count` steps, a `slow` from its step on): a run rewound past
/// a fault does not meet it again.
pub fn inject(faults: &[Fault]) {
    FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .extend(faults.iter().map(|&f| (f, false)));
}

/// The armed, unfired faults that `hit` selects; `fired` marks them.
fn armed(hit: impl Fn(&Fault) -> bool, fired: impl Fn(&Fault) -> bool) -> Vec<Fault> {
    let mut faults = FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = Vec::new();
    for (f, done) in faults.iter_mut() {
        if !*done && hit(f) {
            *done = fired(f);
            out.push(*f);
        }
    }
    out
}

/// Fires the kills and hangs armed for world rank `rank` at step `step`
/// (1-based), as the step begins.
pub(crate) fn before_step(step: u64, rank: usize) {
    let hit = |f: &Fault| {
        f.rank == rank && f.step == step && matches!(f.kind, FaultKind::Kill | FaultKind::Hang)
    };
    if let Some(f) = armed(hit, |_| true).first() {
        if f.kind == FaultKind::Kill {
            die();
        }
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// SIGKILLs this process, as a drill asks.
fn die() {
    // SAFETY: sends SIGKILL to this process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// Whether the batch of fault-free step `batch` (1-based) makes the
/// gradients non-finite (a `nan` fault's batches). A data fault stays
/// armed (every rank reads the batch; a rewind leaves it out).
pub(crate) fn nan_at(batch: u64) -> bool {
    let hit = |f: &Fault| f.kind == FaultKind::Nan && (f.step..f.step + f.count).contains(&batch);
    !armed(hit, |_| false).is_empty()
}

/// Whether the batch of fault-free step `batch` (1-based) is garbage (a
/// `spike` fault). A data fault stays armed (every rank reads the batch;
/// a rewind leaves it out).
pub(crate) fn spike_at(batch: u64) -> bool {
    !armed(|f| f.kind == FaultKind::Spike && f.step == batch, |_| false).is_empty()
}

/// A `spike` fault's garbage: `targets` replaced by tokens drawn from a
/// generator seeded by the batch, so the model is confidently wrong.
pub(crate) fn scramble(targets: &mut [u32], vocab: usize, batch: u64) {
    let mut x = batch.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for t in targets {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *t = u32::try_from(x % vocab.max(1) as u64).unwrap_or(0);
    }
}

/// How many times slower world rank `rank` computes at step `step` (1:
/// not slowed).
pub(crate) fn slowdown(step: u64, rank: usize) -> f64 {
    armed(
        |f| f.kind == FaultKind::Slow && f.rank == rank && step >= f.step,
        |_| false,
    )
    .iter()
    .map(|f| f.factor)
    .product()
}

/// Kills world rank `rank` while it saves the checkpoint of step `step`,
/// if a `crash-during-save` fault says so.
pub(crate) fn during_save(step: u64, rank: usize) {
    let hit = |f: &Fault| f.kind == FaultKind::CrashDuringSave && f.rank == rank && f.step == step;
    if !armed(hit, |_| true).is_empty() {
        die();
    }
}

/// Flips a byte in the middle of the largest file of the committed
/// checkpoint `dir` (step `step`), if a `corrupt-checkpoint` fault says
/// so; on world rank 0 only.
pub(crate) fn after_save(dir: &Path, step: u64, rank: usize) {
    let hit = |f: &Fault| f.kind == FaultKind::CorruptCheckpoint && f.step == step;
    if rank != 0 || armed(hit, |_| true).is_empty() {
        return;
    }
    let largest = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
        .max();
    if let Some((len, path)) = largest
        && let Ok(mut bytes) = std::fs::read(&path)
        && len > 0
    {
        let at = bytes.len() / 2;
        bytes[at] ^= 0x5a;
        let _ = std::fs::write(&path, bytes);
    }
}

/// Writes the heartbeat: the last step done (rank 0 of the child). Errors
/// are ignored: a heartbeat that cannot be written shows as a stopped one.
pub(crate) fn heartbeat(run_dir: &Path, step: u64) {
    let tmp = run_dir.join("heartbeat.tmp");
    if std::fs::write(&tmp, format!("{step}\n")).is_ok() {
        let _ = std::fs::rename(&tmp, run_dir.join("heartbeat"));
    }
}

/// How to supervise a job.
#[derive(Clone, Debug)]
pub struct Supervisor {
    /// The child's command line (program first), without `--resume`.
    pub command: Vec<OsString>,
    /// The run folder the child writes.
    pub run_dir: PathBuf,
    /// Restarts allowed after failures.
    pub max_restarts: u32,
    /// Wait before the first restart; doubled after each.
    pub backoff: Duration,
    /// A heartbeat older than this is a hang.
    pub heartbeat_timeout: Duration,
    /// Faults for the first attempt only.
    pub inject: Vec<Fault>,
}

/// How a supervised job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Restarts made.
    pub restarts: u32,
    /// The last attempt's exit status (`None`: killed by a signal).
    pub code: Option<i32>,
}

/// Why supervision stopped without a finished run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SuperviseError {
    /// The child could not be started.
    #[error("cannot start {command}: {source}")]
    Spawn {
        /// The program.
        command: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The job kept failing.
    #[error(
        "the run failed {failures} time(s), the last time by {last}; gave up after {restarts} restart(s) (--max-restarts)"
    )]
    GaveUp {
        /// Failures seen.
        failures: u32,
        /// Restarts made.
        restarts: u32,
        /// The last failure.
        last: String,
    },
}

/// Appends one event line to `run_dir/events.jsonl`.
///
/// # Errors
/// The file's I/O error.
pub(crate) fn append_event(run_dir: &Path, value: &serde_json::Value) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join("events.jsonl"))?;
    writeln!(f, "{value}")
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The last step the heartbeat names, if any.
fn beat(run_dir: &Path) -> Option<u64> {
    std::fs::read_to_string(run_dir.join("heartbeat"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The step of the newest checkpoint that verifies, if any, and the
/// newer ones that do not (each with why).
fn newest_checkpoint(run_dir: &Path) -> (Option<u64>, Vec<String>) {
    match weft_checkpoint::load_latest(
        &run_dir.join("checkpoints"),
        weft_checkpoint::VerifyLevel::Full,
    ) {
        Ok(Some(l)) => (
            Some(l.checkpoint.step()),
            l.skipped
                .iter()
                .map(|(p, e)| format!("{}: {e}", p.display()))
                .collect(),
        ),
        _ => (None, Vec::new()),
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "an unknown status".into(),
    }
}

impl Supervisor {
    /// Appends `value` to `events.jsonl`, with the events held back while
    /// the run folder did not exist yet (the first attempt creates it).
    fn event(
        &self,
        pending: &std::cell::RefCell<Vec<serde_json::Value>>,
        value: serde_json::Value,
    ) {
        let mut pending = pending.borrow_mut();
        pending.push(value);
        if !self.run_dir.is_dir() {
            return;
        }
        for v in pending.drain(..) {
            let _ = append_event(&self.run_dir, &v);
        }
    }

    fn spawn(&self, attempt: u32, resume: bool) -> Result<Child, SuperviseError> {
        let mut cmd = Command::new(&self.command[0]);
        cmd.args(&self.command[1..]);
        if resume {
            cmd.arg("--resume");
        }
        if attempt == 0 {
            for f in &self.inject {
                cmd.arg("--inject").arg(f.to_string());
            }
        }
        cmd.spawn().map_err(|source| SuperviseError::Spawn {
            command: self.command[0].to_string_lossy().into_owned(),
            source,
        })
    }

    /// Runs the job to the end, restarting it after failures.
    ///
    /// # Errors
    /// [`SuperviseError`] when the child cannot start or keeps failing.
    pub fn run(&self) -> Result<Outcome, SuperviseError> {
        let mut restarts = 0u32;
        let mut failures = 0u32;
        let mut backoff = self.backoff;
        // a run folder with a checkpoint already: continue it
        let mut resume = newest_checkpoint(&self.run_dir).0.is_some();
        let mut attempt = 0u32;
        let pending = std::cell::RefCell::new(Vec::new());
        loop {
            let started = Instant::now();
            let mut child = self.spawn(attempt, resume)?;
            self.event(
                &pending,
                serde_json::json!({
                    "time": unix_now(), "event": "start", "attempt": attempt,
                    "resume": resume, "pid": child.id(),
                }),
            );
            let mut last = (beat(&self.run_dir), Instant::now());
            let mut forwarded = false;
            let failure = loop {
                if crate::stop::requested() && !forwarded {
                    // asked to stop: the child saves and stops
                    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                        // SAFETY: signals our own child process.
                        unsafe {
                            libc::kill(pid, libc::SIGTERM);
                        }
                    }
                    forwarded = true;
                }
                if let Ok(Some(status)) = child.try_wait() {
                    if status.success() {
                        self.event(
                            &pending,
                            serde_json::json!({
                                "time": unix_now(), "event": "finished", "attempt": attempt,
                                "restarts": restarts,
                            }),
                        );
                        return Ok(Outcome {
                            restarts,
                            code: status.code(),
                        });
                    }
                    if crate::stop::requested() {
                        // stopped as asked: saved, not failed
                        self.event(
                            &pending,
                            serde_json::json!({
                                "time": unix_now(), "event": "stopped", "attempt": attempt,
                            }),
                        );
                        return Ok(Outcome {
                            restarts,
                            code: status.code(),
                        });
                    }
                    break describe(status);
                }
                let now = beat(&self.run_dir);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > self.heartbeat_timeout {
                    let _ = child.kill();
                    let _ = child.wait();
                    break format!(
                        "no heartbeat for {:.0} s (after step {})",
                        self.heartbeat_timeout.as_secs_f64(),
                        now.map_or_else(|| "none".into(), |s| s.to_string())
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            failures += 1;
            let seen = beat(&self.run_dir);
            let (from, unverified) = newest_checkpoint(&self.run_dir);
            self.event(
                &pending,
                serde_json::json!({
                    "time": unix_now(), "event": "failure", "attempt": attempt,
                    "failure": failure, "last_step": seen, "ran_s": started.elapsed().as_secs_f64(),
                }),
            );
            if restarts >= self.max_restarts {
                return Err(SuperviseError::GaveUp {
                    failures,
                    restarts,
                    last: failure,
                });
            }
            std::thread::sleep(backoff);
            backoff = backoff.saturating_mul(2);
            restarts += 1;
            attempt += 1;
            resume = from.is_some();
            if !resume && self.run_dir.exists() {
                // nothing saved yet: start over, the failed attempt's
                // folder kept beside
                let aside = PathBuf::from(format!(
                    "{}.attempt-{}",
                    self.run_dir.display(),
                    attempt - 1
                ));
                let _ = std::fs::rename(&self.run_dir, &aside);
            }
            self.event(
                &pending,
                serde_json::json!({
                    "time": unix_now(), "event": "restart", "attempt": attempt,
                    "from_checkpoint_step": from, "unverified_checkpoints": unverified,
                    "lost_steps": seen.unwrap_or(0).saturating_sub(from.unwrap_or(0)),
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Fault, FaultKind};

    #[test]
    fn faults_parse_print_and_refuse_what_they_cannot_be() {
        for text in [
            "kill:step=37",
            "kill:step=37,rank=1",
            "hang:step=50,rank=2",
            "nan:step=60,count=3",
            "spike:step=45",
            "slow:step=1,rank=1,factor=3",
            "corrupt-checkpoint:step=40",
            "crash-during-save:step=80",
        ] {
            let f: Fault = text.parse().unwrap();
            assert_eq!(f.to_string(), text);
            assert_eq!(f.to_string().parse::<Fault>().unwrap(), f);
        }
        let f: Fault = "kill:rank=1,step=37".parse().unwrap();
        assert_eq!((f.kind, f.rank, f.step), (FaultKind::Kill, 1, 37));
        let slow: Fault = "slow:rank=1,factor=3".parse().unwrap();
        assert_eq!((slow.step, slow.factor), (1, 3.0));
        for (bad, says) in [
            ("explode:step=1", "unknown fault \"explode\""),
            ("kill", "step=N is missing"),
            ("kill:step=0", "a step ≥ 1"),
            ("kill:step=x", "a step ≥ 1"),
            ("kill:step=3,count=2", "\"count\" is not a setting of kill"),
            ("slow:factor=0.5", "a factor ≥ 1"),
            ("nan:step=3,count=0", "a count ≥ 1"),
            ("hang:rank=-1,step=2", "a rank ≥ 0"),
            ("kill:step", "is not KEY=VALUE"),
        ] {
            let e = bad.parse::<Fault>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
