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
//! [`Fault`]s (`--inject kill:step=37`, `hang:step=50`) are for tests and
//! drills: the supervisor passes them to the first attempt only, so a
//! restarted run goes on fault-free.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A fault injected into a run for tests and drills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The process is killed (SIGKILL, as by the OOM killer or a lost node)
    /// as step `step` begins.
    Kill {
        /// The step (1-based) that never finishes.
        step: u64,
    },
    /// Rank 0 stops making progress as step `step` begins (a rank stuck in
    /// a kernel): only a heartbeat notices.
    Hang {
        /// The step (1-based) that never finishes.
        step: u64,
    },
}

impl std::str::FromStr for Fault {
    type Err = String;

    /// `kill:step=N` or `hang:step=N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("--inject {s:?}: expected kill:step=N or hang:step=N (N ≥ 1)");
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        let step: u64 = rest
            .strip_prefix("step=")
            .and_then(|n| n.parse().ok())
            .filter(|&n| n >= 1)
            .ok_or_else(bad)?;
        match kind {
            "kill" => Ok(Fault::Kill { step }),
            "hang" => Ok(Fault::Hang { step }),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Kill { step } => write!(f, "kill:step={step}"),
            Fault::Hang { step } => write!(f, "hang:step={step}"),
        }
    }
}

static FAULTS: Mutex<Vec<Fault>> = Mutex::new(Vec::new());

/// Arms `faults` for the runs of this process.
pub fn inject(faults: &[Fault]) {
    FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .extend_from_slice(faults);
}

/// Fires the faults armed for step `step` (1-based), on world rank 0.
pub(crate) fn before_step(step: u64, rank: usize) {
    if rank != 0 {
        return;
    }
    let faults = FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for f in faults {
        match f {
            Fault::Kill { step: s } if s == step => {
                // SAFETY: sends SIGKILL to this process, as the drill asks.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            Fault::Hang { step: s } if s == step => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            _ => {}
        }
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

fn unix_now() -> f64 {
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

/// The step of the newest checkpoint that verifies, if any.
fn newest_checkpoint(run_dir: &Path) -> Option<u64> {
    weft_checkpoint::load_latest(
        &run_dir.join("checkpoints"),
        weft_checkpoint::VerifyLevel::Full,
    )
    .ok()
    .flatten()
    .map(|l| l.checkpoint.step())
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
        let path = self.run_dir.join("events.jsonl");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            for v in pending.drain(..) {
                let _ = writeln!(f, "{v}");
            }
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
        let mut resume = newest_checkpoint(&self.run_dir).is_some();
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
            let from = newest_checkpoint(&self.run_dir);
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
                    "from_checkpoint_step": from,
                    "lost_steps": seen.unwrap_or(0).saturating_sub(from.unwrap_or(0)),
                }),
            );
        }
    }
}
