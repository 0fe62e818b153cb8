//! Supervision: run a job as child process(es), watch it, and restart it
//! from its newest checkpoint that verifies when it fails — with no person
//! awake — plus the faults to drill it with.
//!
//! `weft train --supervise` runs the same `weft train` as a child, or
//! under a launcher (`--launch 'mpirun -np {n}'`, see
//! [`Supervisor::launch`]), in a process group of its own. Every rank
//! writes a heartbeat (`<run>/heartbeats/rank-R`: the last step done) at
//! the start and after every step. The supervisor restarts the job, with
//! `--resume`, when it exits with an error or is killed, or when a rank's
//! heartbeat stops for longer than the heartbeat timeout (then it kills
//! the process group first). The failed rank is the one the launcher's or
//! the collectives' watchdog's message on stderr names (the stream is
//! passed through), else the ranks whose heartbeat fell behind. Restarts
//! are bounded (`max_restarts`) and spaced by a backoff that doubles from
//! `backoff`; with spares ([`Elastic`]) each failure uses one, and with
//! none left the job may shrink to fewer data-parallel replicas. Each
//! start, failure, restart and the end are appended to
//! `<run>/events.jsonl`: when, which attempt and rank, what failed, the
//! checkpoint resumed from (and the newer ones that did not verify), the
//! steps lost, the layout.
//!
//! ```no_run
//! use std::time::Duration;
//! use weft_trainer::supervise::{Elastic, Supervisor};
//!
//! let outcome = Supervisor {
//!     command: vec!["weft".into(), "train".into(), "--set".into(), "run.name=job".into()],
//!     launch: ["mpirun", "-np", "{n}", "--hostfile", "{hostfile}"].map(String::from).to_vec(),
//!     hostfile: Some("hosts.txt".into()),
//!     run_dir: "runs/job".into(),
//!     max_restarts: 3,
//!     backoff: Duration::from_secs(1),
//!     heartbeat_timeout: Duration::from_secs(600),
//!     inject: Vec::new(),
//!     elastic: Elastic { dp: 4, replica: 2, spares: Some(1), shrink: vec![2, 1], micro: 4 },
//! }
//! .run()?;
//! println!("{} restart(s), ending on dp = {}", outcome.restarts, outcome.dp);
//! # Ok::<(), weft_trainer::supervise::SuperviseError>(())
//! ```
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

/// Records that fault `f` fires now on world rank `rank`, in
/// `run_dir/events.jsonl` (a drill measures detection from it).
pub(crate) fn fired(run_dir: &Path, f: &Fault, rank: usize) {
    let _ = append_event(
        run_dir,
        &serde_json::json!({
            "time": unix_now(), "event": "fault", "fault": f.to_string(), "rank": rank,
        }),
    );
}

/// Fires the kills and hangs armed for world rank `rank` at step `step`
/// (1-based), as the step begins.
pub(crate) fn before_step(run_dir: &Path, step: u64, rank: usize) {
    let hit = |f: &Fault| {
        f.rank == rank && f.step == step && matches!(f.kind, FaultKind::Kill | FaultKind::Hang)
    };
    if let Some(f) = armed(hit, |_| true).first() {
        fired(run_dir, f, rank);
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
pub(crate) fn nan_at(batch: u64) -> Option<Fault> {
    let hit = |f: &Fault| f.kind == FaultKind::Nan && (f.step..f.step + f.count).contains(&batch);
    armed(hit, |_| false).first().copied()
}

/// Whether the batch of fault-free step `batch` (1-based) is garbage (a
/// `spike` fault). A data fault stays armed (every rank reads the batch;
/// a rewind leaves it out).
pub(crate) fn spike_at(batch: u64) -> Option<Fault> {
    armed(|f| f.kind == FaultKind::Spike && f.step == batch, |_| false)
        .first()
        .copied()
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

/// Kills world rank `rank` while it saves the checkpoint of step `step`
/// of run `run_dir`, if a `crash-during-save` fault says so.
pub(crate) fn during_save(run_dir: &Path, step: u64, rank: usize) {
    let hit = |f: &Fault| f.kind == FaultKind::CrashDuringSave && f.rank == rank && f.step == step;
    if let Some(f) = armed(hit, |_| true).first() {
        fired(run_dir, f, rank);
        die();
    }
}

/// Flips a byte in the middle of the largest file of the committed
/// checkpoint `dir` (step `step`), if a `corrupt-checkpoint` fault says
/// so; on world rank 0 only.
pub(crate) fn after_save(dir: &Path, step: u64, rank: usize) {
    let hit = |f: &Fault| f.kind == FaultKind::CorruptCheckpoint && f.step == step;
    let Some(f) = (rank == 0)
        .then(|| armed(hit, |_| true))
        .and_then(|v| v.first().copied())
    else {
        return;
    };
    if let Some(run_dir) = dir.parent().and_then(Path::parent) {
        fired(run_dir, &f, rank);
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

/// Writes world rank `rank`'s heartbeat, `<run>/heartbeats/rank-R`: the
/// last step it finished, its process id and its host. Errors are ignored: a
/// heartbeat that cannot be written shows as a stopped one.
pub(crate) fn heartbeat(run_dir: &Path, rank: usize, step: u64) {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let host = HOST.get_or_init(crate::ranks::host_name);
    let dir = run_dir.join("heartbeats");
    let _ = std::fs::create_dir_all(&dir);
    let tmp = dir.join(format!("rank-{rank}.tmp"));
    if std::fs::write(&tmp, format!("{step} {} {host}\n", std::process::id())).is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(format!("rank-{rank}")));
    }
}

/// The host world rank `rank`'s heartbeat names, if any.
fn beat_host(run_dir: &Path, rank: usize) -> Option<String> {
    std::fs::read_to_string(run_dir.join("heartbeats").join(format!("rank-{rank}")))
        .ok()?
        .split_whitespace()
        .nth(2)
        .map(str::to_owned)
}

/// The last step world rank `rank`'s heartbeat names, if any.
fn beat(run_dir: &Path, rank: usize) -> Option<u64> {
    std::fs::read_to_string(run_dir.join("heartbeats").join(format!("rank-{rank}")))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The layout a supervised job runs on, and how it may change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elastic {
    /// The data-parallel degree the job starts with.
    pub dp: usize,
    /// Ranks per data-parallel replica (tensor × pipeline degrees): the
    /// world is `dp` of them.
    pub replica: usize,
    /// Spare ranks: each failure is taken over by one, the layout
    /// unchanged. `None`: every restart keeps the layout (the failed
    /// machine is assumed repaired or replaced by the scheduler).
    pub spares: Option<u32>,
    /// Smaller data-parallel degrees the configuration allows, largest
    /// first: with no spare left, a failure continues on the next one
    /// (empty: it ends the supervision).
    pub shrink: Vec<usize>,
    /// The micro-batch size, pinned when the job shrinks so the global
    /// batch is kept by more accumulation.
    pub micro: usize,
}

/// How to supervise a job.
#[derive(Clone, Debug)]
pub struct Supervisor {
    /// The job's command line (program first), without `--resume`.
    pub command: Vec<OsString>,
    /// A launcher to run the command under, one argument per word, `{n}`
    /// standing for the number of processes (e.g. `mpirun -np {n}`);
    /// empty: the command runs as one process. `{hostfile}` stands for
    /// [`Supervisor::hostfile`] less the hosts of failed ranks.
    pub launch: Vec<String>,
    /// The launcher's hostfile (one host per line, first word the host,
    /// as Open MPI's `host slots=N`): a failed rank's host is left out of
    /// the copy each restart passes as `{hostfile}`, so the launcher
    /// places the job on the hosts left (spare nodes listed there take
    /// over).
    pub hostfile: Option<PathBuf>,
    /// The run folder the job writes.
    pub run_dir: PathBuf,
    /// Restarts allowed after failures.
    pub max_restarts: u32,
    /// Wait before the first restart; doubled after each.
    pub backoff: Duration,
    /// A rank whose heartbeat is older than this is hung.
    pub heartbeat_timeout: Duration,
    /// Faults for the first attempt only.
    pub inject: Vec<Fault>,
    /// The layout, spares and shrinking.
    pub elastic: Elastic,
}

/// How a supervised job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Restarts made.
    pub restarts: u32,
    /// The last attempt's exit status (`None`: killed by a signal).
    pub code: Option<i32>,
    /// The data-parallel degree the job ended on.
    pub dp: usize,
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
    /// The job's first start failed before its first step without being
    /// killed (its error printed above): not restarted, as a restart
    /// would repeat it.
    #[error(
        "the job failed before training ({status}); not restarted, since a set-up error (configuration, data, libraries) would fail again"
    )]
    SetUp {
        /// Its exit status.
        status: String,
    },
    /// The hostfile could not be read or its copy written.
    #[error("hostfile {path}: {source}")]
    Hostfile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The job kept failing.
    #[error(
        "the run failed {failures} time(s), the last time by {last}; gave up after {restarts} restart(s) ({why})"
    )]
    GaveUp {
        /// Failures seen.
        failures: u32,
        /// Restarts made.
        restarts: u32,
        /// The last failure.
        last: String,
        /// What ran out.
        why: String,
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
    // one write of the whole line: appends of one write each never
    // interleave, whereas formatting straight into the file writes it in
    // pieces, which a rank's checkpoint thread and its training thread (or
    // the supervisor) could interleave into lines no reader can parse
    let mut line = value.to_string().into_bytes();
    line.push(b'\n');
    f.write_all(&line)
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
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
        Err(weft_checkpoint::Error::NoValidCheckpoint { failures, .. }) => (
            None,
            failures
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

/// The rank a failure message names: Open MPI's ("... process rank 1 with
/// PID 4242 on node vm exited on signal 9") or the collectives' watchdog's
/// ("... ranks \[1\] did not arrive ...").
fn rank_named(line: &str) -> Option<usize> {
    let after = |key: &str| Some(&line[line.find(key)? + key.len()..]);
    let rest = after("process rank ").or_else(|| {
        line.contains("did not arrive")
            .then(|| after("ranks ["))
            .flatten()
    })?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The host Open MPI's message names ("... on node vm exited ...").
fn host_named(line: &str) -> Option<String> {
    let rest = &line[line.find(" on node ")? + " on node ".len()..];
    rest.split_whitespace().next().map(str::to_owned)
}

/// The slots a hostfile offers (`slots=N` on a line, else 1 per line).
fn slots(hostfile: &str) -> usize {
    hostfile
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("slots=")?.parse().ok())
                .unwrap_or(1)
        })
        .sum()
}

/// `hostfile`'s lines less those of the `excluded` hosts (comments and
/// blank lines kept).
fn without_hosts(hostfile: &str, excluded: &[String]) -> String {
    hostfile
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_none_or(|h| h.starts_with('#') || !excluded.iter().any(|e| e == h))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Sends `signal` to process `pid` (`group`: to its process group).
fn signal(pid: u32, group: bool, signal: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: signals our own child (or its process group).
        unsafe {
            libc::kill(if group { -pid } else { pid }, signal);
        }
    }
}

/// A running attempt: the child and what its stderr said.
struct Running {
    child: Child,
    /// The first line of its stderr that named a failed rank.
    failed_rank: std::sync::Arc<Mutex<Option<String>>>,
    /// Forwards the child's stderr.
    relay: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    /// The line of stderr that named a failed rank, if any.
    fn named(&self) -> Option<String> {
        self.failed_rank
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Waits for the child and the relay of its stderr.
    fn reap(&mut self) {
        let _ = self.child.wait();
        if let Some(r) = self.relay.take() {
            let _ = r.join();
        }
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

    fn spawn(
        &self,
        attempt: u32,
        resume: bool,
        dp: usize,
        hosts: Option<&Path>,
    ) -> Result<Running, SuperviseError> {
        use std::os::unix::process::CommandExt;
        let world = dp * self.elastic.replica;
        let hosts = hosts
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut words: Vec<OsString> = self
            .launch
            .iter()
            .map(|w| {
                w.replace("{n}", &world.to_string())
                    .replace("{hostfile}", &hosts)
                    .into()
            })
            .collect();
        words.extend(self.command.iter().cloned());
        let mut cmd = Command::new(&words[0]);
        cmd.args(&words[1..]);
        if dp != self.elastic.dp {
            // shrunk: fewer replicas, the same global batch
            cmd.args(["--set", &format!("parallel.dp={dp}")]);
            cmd.args([
                "--set",
                &format!("train.micro_batch_size={}", self.elastic.micro),
            ]);
        }
        if resume {
            cmd.arg("--resume");
        }
        if attempt == 0 {
            for f in &self.inject {
                cmd.arg("--inject").arg(f.to_string());
            }
        }
        // its own process group: a hang is killed with all it started, and
        // a terminal's Ctrl-C reaches only the supervisor, which forwards it
        cmd.process_group(0);
        cmd.stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| SuperviseError::Spawn {
            command: words[0].to_string_lossy().into_owned(),
            source,
        })?;
        let failed_rank = std::sync::Arc::new(Mutex::new(None));
        let relay = child.stderr.take().map(|err| {
            let failed = std::sync::Arc::clone(&failed_rank);
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                    if rank_named(&line).is_some() {
                        failed
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .get_or_insert_with(|| line.clone());
                    }
                    let _ = writeln!(std::io::stderr().lock(), "{line}");
                }
            })
        });
        Ok(Running {
            child,
            failed_rank,
            relay,
        })
    }

    /// The hostfile for an attempt: the given one at first; after a host
    /// failed, a copy without it in the run folder.
    fn hosts_now(
        &self,
        excluded: &[String],
        attempt: u32,
    ) -> Result<Option<PathBuf>, SuperviseError> {
        let Some(file) = &self.hostfile else {
            return Ok(None);
        };
        if excluded.is_empty() {
            return Ok(Some(file.clone()));
        }
        let text = std::fs::read_to_string(file).map_err(|source| SuperviseError::Hostfile {
            path: file.clone(),
            source,
        })?;
        let out = self.run_dir.join(format!("hostfile.attempt-{attempt}"));
        let _ = std::fs::create_dir_all(&self.run_dir);
        std::fs::write(&out, without_hosts(&text, excluded)).map_err(|source| {
            SuperviseError::Hostfile {
                path: out.clone(),
                source,
            }
        })?;
        Ok(Some(out))
    }

    /// Runs the job to the end, restarting it after failures.
    ///
    /// # Errors
    /// [`SuperviseError`] when the child cannot start or keeps failing.
    #[allow(clippy::too_many_lines)]
    pub fn run(&self) -> Result<Outcome, SuperviseError> {
        let mut restarts = 0u32;
        let mut failures = 0u32;
        let mut backoff = self.backoff;
        // a run folder with a checkpoint already: continue it
        let mut resume = newest_checkpoint(&self.run_dir).0.is_some();
        let mut attempt = 0u32;
        let mut dp = self.elastic.dp;
        let mut spares = self.elastic.spares;
        // hosts of failed ranks, left out of the hostfile
        let mut excluded: Vec<String> = Vec::new();
        let pending = std::cell::RefCell::new(Vec::new());
        loop {
            let world = dp * self.elastic.replica;
            // the last attempt's beats are not this one's
            let _ = std::fs::remove_dir_all(self.run_dir.join("heartbeats"));
            let started = Instant::now();
            let hosts = self.hosts_now(&excluded, attempt)?;
            let mut run = self.spawn(attempt, resume, dp, hosts.as_deref())?;
            self.event(
                &pending,
                serde_json::json!({
                    "time": unix_now(), "event": "start", "attempt": attempt,
                    "resume": resume, "pid": run.child.id(), "dp": dp, "ranks": world,
                }),
            );
            // every rank's last beat and when it changed
            let mut beats: Vec<(Option<u64>, Instant)> = vec![(None, started); world];
            let mut forwarded = false;
            let mut running = false;
            let (failure, rank) = loop {
                if crate::stop::requested() && !forwarded {
                    // asked to stop: the job saves and stops (a launcher
                    // forwards the signal to its ranks)
                    signal(run.child.id(), false, libc::SIGTERM);
                    forwarded = true;
                }
                if let Ok(Some(status)) = run.child.try_wait() {
                    run.reap();
                    if status.success() || crate::stop::requested() {
                        let event = if status.success() {
                            "finished"
                        } else {
                            "stopped"
                        };
                        self.event(
                            &pending,
                            serde_json::json!({
                                "time": unix_now(), "event": event, "attempt": attempt,
                                "restarts": restarts, "dp": dp,
                            }),
                        );
                        return Ok(Outcome {
                            restarts,
                            code: status.code(),
                            dp,
                        });
                    }
                    let named = run.named();
                    let rank = named.as_deref().and_then(rank_named);
                    if attempt == 0 && status.code().is_some() && !running {
                        // the first start never trained and was not
                        // killed: a bad config, a missing file or library,
                        // which a restart would only repeat
                        self.event(
                            &pending,
                            serde_json::json!({
                                "time": unix_now(), "event": "failure", "attempt": attempt,
                                "failure": describe(status), "rank": rank, "before_training": true,
                            }),
                        );
                        return Err(SuperviseError::SetUp {
                            status: describe(status),
                        });
                    }
                    break (describe(status), rank);
                }
                for (r, b) in beats.iter_mut().enumerate() {
                    let now = beat(&self.run_dir, r);
                    if now != b.0 {
                        *b = (now, Instant::now());
                    }
                }
                if !running && let Some(step) = beats[0].0 {
                    // built, restored and about to train: the restart's
                    // cost ends here
                    running = true;
                    self.event(
                        &pending,
                        serde_json::json!({
                            "time": unix_now(), "event": "running", "attempt": attempt,
                            "step": step, "after_s": started.elapsed().as_secs_f64(),
                        }),
                    );
                }
                // a rank silent too long: the job is hung
                if beats
                    .iter()
                    .any(|(_, since)| since.elapsed() > self.heartbeat_timeout)
                {
                    signal(run.child.id(), true, libc::SIGKILL);
                    run.reap();
                    // the ranks behind the others, if not all
                    let last = beats.iter().map(|b| b.0).min().flatten();
                    let behind: Vec<usize> = (0..world).filter(|&r| beats[r].0 == last).collect();
                    let step = last.map_or_else(|| "none".into(), |s| s.to_string());
                    let who = if behind.len() < world {
                        format!("from rank(s) {behind:?} (after step {step}; the others are ahead)")
                    } else if world > 1 {
                        format!("from any rank (every rank after step {step})")
                    } else {
                        format!("(after step {step})")
                    };
                    let named = run.named().as_deref().and_then(rank_named);
                    break (
                        format!(
                            "no heartbeat {who} for {:.0} s",
                            self.heartbeat_timeout.as_secs_f64()
                        ),
                        named.or_else(|| (behind.len() < world).then(|| behind[0])),
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            failures += 1;
            let seen = (0..world).filter_map(|r| beat(&self.run_dir, r)).max();
            // the failed rank's host: as the launcher names it, else from
            // the rank's heartbeat
            let host = run
                .named()
                .as_deref()
                .and_then(host_named)
                .or_else(|| rank.and_then(|r| beat_host(&self.run_dir, r)));
            if let (Some(file), Some(h)) = (&self.hostfile, &host)
                && !excluded.contains(h)
            {
                // left out only if the hosts left can hold the job (else
                // it is tried again, as without a hostfile)
                let text = std::fs::read_to_string(file).unwrap_or_default();
                let mut without = excluded.clone();
                without.push(h.clone());
                let needed = self.elastic.shrink.last().copied().unwrap_or(dp).min(dp)
                    * self.elastic.replica;
                if slots(&without_hosts(&text, &without)) >= needed {
                    excluded = without;
                }
            }
            let (from, unverified) = newest_checkpoint(&self.run_dir);
            self.event(
                &pending,
                serde_json::json!({
                    "time": unix_now(), "event": "failure", "attempt": attempt,
                    "failure": failure, "rank": rank, "host": host, "last_step": seen,
                    "ran_s": started.elapsed().as_secs_f64(),
                }),
            );
            let give_up = |why: String| SuperviseError::GaveUp {
                failures,
                restarts,
                last: failure.clone(),
                why,
            };
            if restarts >= self.max_restarts {
                return Err(give_up(format!("--max-restarts {}", self.max_restarts)));
            }
            // who takes the failed rank's place
            let action = match spares {
                None => "same layout".to_owned(),
                Some(k) if k > 0 => {
                    spares = Some(k - 1);
                    format!("a spare took over ({} left)", k - 1)
                }
                Some(_) => match self.elastic.shrink.iter().find(|&&d| d < dp) {
                    Some(&d) => {
                        let was = dp;
                        dp = d;
                        format!(
                            "no spare left: continuing on parallel.dp = {d} (was {was}), the global batch kept by accumulation"
                        )
                    }
                    None => {
                        return Err(give_up(
                            "no spare rank left and no smaller layout allowed (--shrink)".into(),
                        ));
                    }
                },
            };
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
                // the run's history goes on in the new folder
                let history =
                    std::fs::read_to_string(self.run_dir.join("events.jsonl")).unwrap_or_default();
                if std::fs::rename(&self.run_dir, &aside).is_ok() {
                    let mut p = pending.borrow_mut();
                    let earlier: Vec<serde_json::Value> = history
                        .lines()
                        .filter_map(|l| serde_json::from_str(l).ok())
                        .collect();
                    p.splice(0..0, earlier);
                }
            }
            self.event(
                &pending,
                serde_json::json!({
                    "time": unix_now(), "event": "restart", "attempt": attempt,
                    "from_checkpoint_step": from, "unverified_checkpoints": unverified,
                    "lost_steps": seen.unwrap_or(0).saturating_sub(from.unwrap_or(0)),
                    "action": action, "dp": dp, "ranks": dp * self.elastic.replica,
                    "spares_left": spares, "excluded_hosts": excluded,
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Fault, FaultKind};

    /// Events appended at once from several threads stay whole lines.
    #[test]
    fn concurrent_events_stay_whole_lines() {
        let dir = std::env::temp_dir().join(format!("weft-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::thread::scope(|s| {
            for t in 0..4 {
                let dir = &dir;
                s.spawn(move || {
                    for i in 0..200 {
                        let v = serde_json::json!({"event": "x", "thread": t, "i": i, "pad": "y".repeat(200)});
                        super::append_event(dir, &v).unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(dir.join("events.jsonl")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(text.lines().count(), 800);
        for l in text.lines() {
            serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        }
    }

    #[test]
    fn a_failed_host_leaves_the_hostfile() {
        let file = "# nodes\nnode-a slots=8\nnode-b slots=8\n\nnode-c slots=8\n";
        assert_eq!(
            super::without_hosts(file, &["node-b".into()]),
            "# nodes\nnode-a slots=8\n\nnode-c slots=8\n"
        );
        assert_eq!(super::slots(file), 24);
        assert_eq!(super::slots("a\nb slots=3 # spare\n# c slots=9\n"), 4);
    }

    #[test]
    fn the_failed_rank_is_read_from_the_launcher_and_the_watchdog() {
        use super::rank_named;
        assert_eq!(
            rank_named(
                "mpirun noticed that process rank 1 with PID 4242 on node vm exited on signal 9 (Killed)."
            ),
            Some(1)
        );
        assert_eq!(
            rank_named(
                "error: all_reduce in group world timed out after 4s on rank 0: ranks [3, 2] did not arrive (rank 0 was waiting for [3])"
            ),
            Some(3)
        );
        assert_eq!(rank_named("step 3/10 loss 2.1 ranks [1]"), None);
        assert_eq!(
            super::host_named(
                "mpirun noticed that process rank 1 with PID 4242 on node vm exited on signal 9 (Killed)."
            )
            .as_deref(),
            Some("vm")
        );
    }

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
