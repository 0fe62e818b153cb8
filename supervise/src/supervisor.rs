//! The supervisor: a job as child process(es), watched and restarted.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use weft_trace::{EventKind, RunEvent, input};

use crate::events::{append_event, read_events, stamped};
use crate::fault::Fault;
use crate::heartbeat::{beat, beat_host};

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
    /// over). At each later failure a host left out earlier that answers
    /// the launcher again (the node came back) rejoins it, a spare again.
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

/// How long a launcher may go on after its output named a failure before
/// it counts as stuck and is killed: `mpirun` tears a job down in well
/// under a second when its daemons answer, and waits without end on the
/// daemon of a node that died silently (powered off, its link down).
const TEARDOWN_GRACE: Duration = Duration::from_secs(20);

/// How long a host left out after a failure has to answer the launcher
/// before it counts as still down (see `Supervisor::answers`).
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Whether a launcher line names what failed: a rank ([`rank_named`]) or
/// a whole node whose daemon Open MPI lost (`Remote daemon: [[55631,0],2]
/// on node n1`, when every process of a node is killed or its link goes
/// down; the `HNP daemon` line before it names `mpirun`'s own node).
fn names_failure(line: &str) -> bool {
    rank_named(line).is_some() || line.trim_start().starts_with("Remote daemon:")
}

/// The host Open MPI's message names ("... on node vm exited ...", or the
/// lost daemon's "Remote daemon: ... on node n1").
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
    fn event(&self, pending: &std::cell::RefCell<Vec<RunEvent>>, kind: EventKind) {
        let mut pending = pending.borrow_mut();
        pending.push(stamped(kind));
        if !self.run_dir.is_dir() {
            return;
        }
        for e in pending.drain(..) {
            let _ = append_event(&self.run_dir, &e);
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
        // the job dies with this supervisor, however it dies: a launcher is
        // asked to stop (it stops its ranks), a lone `weft train` killed
        crate::die_with_parent(
            &mut cmd,
            if self.launch.is_empty() {
                libc::SIGKILL
            } else {
                libc::SIGTERM
            },
        );
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
                    if names_failure(&line) {
                        let mut f = failed
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        // the first line naming a failure, unless a lost
                        // node comes after it: the ranks that time out
                        // waiting on a dead node name whoever they waited
                        // for, the node's loss is the cause
                        if f.as_deref()
                            .is_none_or(|l| rank_named(l).is_some() && rank_named(&line).is_none())
                        {
                            *f = Some(line.clone());
                        }
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
        let text = input::read_to_string(file, input::CONFIG_BYTES).map_err(|source| {
            SuperviseError::Hostfile {
                path: file.clone(),
                source,
            }
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

    /// Whether host `host` answers: the launcher run on it alone (`{n}` =
    /// 1, `{hostfile}` a file naming only it) with `true` as the command,
    /// ended within [`PROBE_TIMEOUT`]. A node that died and came back
    /// (repaired, or recreated by the scheduler) answers; one still down
    /// does not (the launcher cannot reach it, and is stopped).
    fn answers(&self, host: &str) -> bool {
        use std::os::unix::process::CommandExt;
        let file = self.run_dir.join("hostfile.probe");
        if std::fs::write(&file, format!("{host} slots=1\n")).is_err() {
            return false;
        }
        let words: Vec<String> = self
            .launch
            .iter()
            .map(|w| {
                w.replace("{n}", "1")
                    .replace("{hostfile}", &file.to_string_lossy())
            })
            .collect();
        let Some((program, args)) = words.split_first() else {
            return false;
        };
        let mut cmd = Command::new(program);
        cmd.args(args)
            .arg("true")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0);
        crate::die_with_parent(&mut cmd, libc::SIGKILL);
        let Ok(mut child) = cmd.spawn() else {
            return false;
        };
        let t0 = Instant::now();
        let ok = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status.success(),
                Ok(None) if t0.elapsed() < PROBE_TIMEOUT => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => {
                    signal(child.id(), true, libc::SIGTERM);
                    std::thread::sleep(Duration::from_millis(500));
                    signal(child.id(), true, libc::SIGKILL);
                    let _ = child.wait();
                    break false;
                }
            }
        };
        let _ = std::fs::remove_file(&file);
        ok
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
        let pending: std::cell::RefCell<Vec<RunEvent>> = std::cell::RefCell::new(Vec::new());
        loop {
            let world = dp * self.elastic.replica;
            // the last attempt's beats are not this one's
            let _ = std::fs::remove_dir_all(self.run_dir.join("heartbeats"));
            let started = Instant::now();
            let hosts = self.hosts_now(&excluded, attempt)?;
            let mut run = self.spawn(attempt, resume, dp, hosts.as_deref())?;
            self.event(
                &pending,
                EventKind::Start {
                    attempt,
                    resume,
                    pid: run.child.id(),
                    dp,
                    ranks: world,
                },
            );
            // every rank's last beat and when it changed
            let mut beats: Vec<(Option<u64>, Instant)> = vec![(None, started); world];
            let mut forwarded = false;
            let mut running = false;
            // when the launcher's output first named a failure
            let mut named_since: Option<Instant> = None;
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
                            EventKind::Finished {
                                attempt,
                                restarts,
                                dp,
                            }
                        } else {
                            EventKind::Stopped {
                                attempt,
                                restarts,
                                dp,
                            }
                        };
                        self.event(&pending, event);
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
                            EventKind::Failure {
                                attempt,
                                failure: describe(status),
                                rank,
                                host: None,
                                last_step: None,
                                ran_s: None,
                                before_training: true,
                            },
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
                        EventKind::Running {
                            attempt,
                            step,
                            after_s: started.elapsed().as_secs_f64(),
                        },
                    );
                }
                // a failure reported (a rank's death, a lost node, a
                // collective that timed out) while the launcher has not
                // ended after a grace: it is stuck tearing down (mpirun
                // waits on a dead node's daemon that no longer answers)
                if named_since.is_none() && run.named().is_some() {
                    named_since = Some(Instant::now());
                }
                if let Some(since) = named_since
                    && since.elapsed() > TEARDOWN_GRACE.min(self.heartbeat_timeout)
                {
                    signal(run.child.id(), true, libc::SIGKILL);
                    run.reap();
                    let named = run.named().as_deref().and_then(rank_named);
                    break (
                        format!(
                            "a failure was reported and the launcher did not end within {:.0} s",
                            since.elapsed().as_secs_f64()
                        ),
                        named,
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
            // a survivor may report first (the link to a dead peer broke):
            // when the named host answers the launcher and another host of
            // the hostfile does not, the silent one is the node that failed
            let host = match (&self.hostfile, host) {
                (Some(file), Some(h)) if self.answers(&h) => {
                    let text = std::fs::read_to_string(file).unwrap_or_default();
                    let silent = without_hosts(&text, &excluded)
                        .lines()
                        .filter_map(|l| l.split_whitespace().next())
                        .filter(|c| !c.starts_with('#') && *c != h)
                        .find(|c| !self.answers(c))
                        .map(str::to_owned);
                    Some(silent.unwrap_or(h))
                }
                (_, h) => h,
            };
            // hosts left out earlier that answer again (the node came
            // back) rejoin the hostfile, each a spare again
            let back: Vec<String> = excluded
                .iter()
                .filter(|h| Some(*h) != host.as_ref() && self.answers(h))
                .cloned()
                .collect();
            if !back.is_empty() {
                excluded.retain(|h| !back.contains(h));
                spares = spares.map(|k| k + u32::try_from(back.len()).unwrap_or(u32::MAX));
            }
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
                EventKind::Failure {
                    attempt,
                    failure: failure.clone(),
                    rank,
                    host: host.clone(),
                    last_step: seen,
                    ran_s: Some(started.elapsed().as_secs_f64()),
                    before_training: false,
                },
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
            let action = if back.is_empty() {
                action
            } else {
                format!("{} back: {action}", back.join(", "))
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
                let earlier = read_events(&self.run_dir);
                if std::fs::rename(&self.run_dir, &aside).is_ok() {
                    pending.borrow_mut().splice(0..0, earlier);
                }
            }
            self.event(
                &pending,
                EventKind::Restart {
                    attempt,
                    from_checkpoint_step: from,
                    unverified_checkpoints: unverified,
                    lost_steps: seen.unwrap_or(0).saturating_sub(from.unwrap_or(0)),
                    action,
                    dp,
                    ranks: dp * self.elastic.replica,
                    spares_left: spares,
                    excluded_hosts: excluded.clone(),
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
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
        // a node lost whole: its daemon's line, not mpirun's own node's
        let lost = [
            "ORTE has lost communication with a remote daemon.",
            "",
            "  HNP daemon   : [[55631,0],0] on node head",
            "  Remote daemon: [[55631,0],2] on node n1",
        ];
        let first = lost.iter().find(|l| super::names_failure(l)).unwrap();
        assert_eq!(rank_named(first), None);
        assert_eq!(super::host_named(first).as_deref(), Some("n1"));
    }
}
