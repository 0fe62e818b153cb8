//! `weft plan --calibrate --launch`: the calibration's layouts as MPI jobs
//! of `weft train` processes on a cluster of nodes, each started by a
//! launcher prefix (Open MPI's `mpirun`, as `scripts/cluster.sh up`
//! prints it) and read back from its run folder: step times from
//! `metrics.jsonl`, rank 0's memory from `summary.json`, FSDP's
//! communication from `trace.json` where it was traced. The links are
//! measured by a two-rank job of `weft plan --probe-link` (one rank on
//! each of two nodes, then two on one node).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::calibrate::{FsdpTime, Job, Measured, Network, Runner, Trial};
use crate::machine::LinkCost;
use crate::memory::Memory;
use crate::{Error, Result};

/// A [`Runner`] whose jobs are MPI jobs of the `weft` binary `exe`.
pub struct Launched<J> {
    /// The launcher prefix (`mpirun --hostfile ...`).
    pub prefix: String,
    /// The `weft` binary the ranks run.
    pub exe: PathBuf,
    /// The job file every layout's settings apply to.
    pub job_file: PathBuf,
    /// Where the runs' folders go (each removed after it is read).
    pub dir: PathBuf,
    /// Tokens of a step (a step's time is these over its tokens/s).
    pub tokens_per_step: f64,
    /// Whether the job sums reproducibly (the links are measured so).
    pub reproducible: bool,
    /// The job a trial makes of the job file, checked.
    pub job: J,
}

fn launch_error(msg: impl Into<String>) -> Error {
    Error::Launch(msg.into())
}

/// `s` quoted for a POSIX shell.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

impl<J> Launched<J> {
    /// A runner of this process's own binary under `prefix`, its job file
    /// (`job_toml`) written into `dir`, which is made.
    ///
    /// # Errors
    /// [`Error::Launch`] when the folder or the file cannot be written, or
    /// this binary's path is unknown.
    pub fn new(
        prefix: &str,
        dir: &Path,
        job_toml: &str,
        tokens_per_step: f64,
        reproducible: bool,
        job: J,
    ) -> Result<Self> {
        let job_file = dir.join("job.toml");
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&job_file, job_toml))
            .map_err(|e| launch_error(format!("cannot write {}: {e}", job_file.display())))?;
        Ok(Launched {
            prefix: prefix.to_owned(),
            exe: std::env::current_exe()
                .map_err(|e| launch_error(format!("this binary's path: {e}")))?,
            job_file,
            dir: dir.to_owned(),
            tokens_per_step,
            reproducible,
            job,
        })
    }

    /// Runs `args` of `exe` as `ranks` processes, `per_node` to a node and
    /// bound to no core (`--map-by ppr:P:node --bind-to none`: their pools
    /// share this machine's cores), under the prefix: its standard output.
    fn launch(&self, ranks: usize, per_node: usize, args: &[String]) -> Result<String> {
        let mut line = format!(
            "{} -np {ranks} --map-by ppr:{per_node}:node --bind-to none {}",
            self.prefix,
            quoted(&self.exe.display().to_string())
        );
        for a in args {
            line.push(' ');
            line.push_str(&quoted(a));
        }
        let out = Command::new("bash")
            .args(["-c", &line])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| launch_error(format!("cannot run `{line}`: {e}")))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().collect();
            return Err(launch_error(format!(
                "`{line}` failed ({}):\n{}",
                out.status,
                tail[tail.len().saturating_sub(12)..].join("\n")
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The link between two ranks placed `per_node` to a node.
    fn probe(&self, per_node: usize) -> Result<LinkCost> {
        let args = [
            "plan".to_owned(),
            "--probe-link".to_owned(),
            "--set".to_owned(),
            format!("parallel.reproducible={}", self.reproducible),
        ];
        let out = self.launch(2, per_node, &args)?;
        out.lines()
            .rev()
            .find_map(|l| serde_json::from_str::<LinkCost>(l.trim()).ok())
            .ok_or_else(|| launch_error(format!("the link probe printed no measurement:\n{out}")))
    }
}

impl<J: FnMut(&Trial) -> Result<Job>> Runner for Launched<J> {
    type Error = Error;

    fn job(&mut self, trial: &Trial) -> Result<Job> {
        if trial.per_node == 0 {
            return Err(launch_error("a launched layout needs its ranks per node"));
        }
        (self.job)(trial)
    }

    fn network(&mut self) -> Result<Option<Network>> {
        let node = self.probe(1)?;
        Ok(Some(Network {
            node: node.link,
            cpu_per_byte: node.cpu_per_byte,
            intra: self.probe(2)?.link,
        }))
    }

    fn run(&mut self, job: &Job, steps: u64) -> Result<Measured> {
        let layout = job.layout.to_string().replace([' ', '/'], "_");
        let name = format!("calibrate-{layout}");
        let mut sets = job.sets.clone();
        if !sets.iter().any(|s| s.starts_with("parallel.threads=")) {
            sets.push(format!("parallel.threads={}", job.threads));
        }
        let traced = if job.layout.shards_params() { steps } else { 0 };
        sets.extend([
            format!("train.steps={steps}"),
            "train.eval_every=0".to_owned(),
            "train.eval_sequences=1".to_owned(),
            "checkpoint.every=0".to_owned(),
            format!("run.dir={:?}", self.dir.display().to_string()),
            format!("run.name={name:?}"),
            format!("run.trace_steps={traced}"),
        ]);
        let mut args = vec![
            "train".to_owned(),
            "--config".to_owned(),
            self.job_file.display().to_string(),
        ];
        for s in sets {
            args.extend(["--set".to_owned(), s]);
        }
        let per_node = job.per_node.min(job.layout.world());
        self.launch(job.layout.world(), per_node, &args)
            .map_err(|e| launch_error(format!("{layout}: {e}")))?;
        let folder = self.dir.join(&name);
        let measured = read_run(&folder, self.tokens_per_step, steps / 5);
        let _ = std::fs::remove_dir_all(&folder);
        measured.map_err(|e| launch_error(format!("{layout}: {e}")))
    }
}

/// A finished run's figures from its folder: its steps' times (tokens
/// per step over each step's tokens/s), rank 0's memory, and FSDP's
/// communication where `trace.json` exists (its first `skip` steps not
/// counted).
///
/// # Errors
/// A file missing or unreadable, or no step to time.
pub fn read_run(folder: &Path, tokens_per_step: f64, skip: u64) -> Result<Measured, String> {
    let read = |f: &str| {
        std::fs::read_to_string(folder.join(f))
            .map_err(|e| format!("{}: {e}", folder.join(f).display()))
    };
    // the steps' records (evaluations and events have lines of their own)
    let step_s: Vec<f64> = read("metrics.jsonl")?
        .lines()
        .filter_map(|l| serde_json::from_str::<weft_trace::MetricsRecord>(l).ok())
        .map(|r| tokens_per_step / r.tokens_per_s)
        .collect();
    let summary: weft_trace::Summary =
        serde_json::from_str(&read("summary.json")?).map_err(|e| format!("summary.json: {e}"))?;
    let m = summary.memory;
    let memory = Memory {
        params: m.params,
        grads: m.grads,
        optimizer: m.optimizer,
        activations: m.activations,
        buffers: m.comm,
    };
    let mut measured = Measured::of_run(&step_s, memory).ok_or("no step was timed")?;
    if folder.join("trace.json").is_file() {
        measured.fsdp = Some(fsdp_time(&read("trace.json")?, skip)?);
    }
    Ok(measured)
}

/// FSDP's communication per step and rank in a `trace.json`: its
/// collectives' spans in flight and the waits on them (category
/// `fsdp.comm`), the first `skip` steps not counted.
///
/// # Errors
/// Not a trace.
pub fn fsdp_time(trace: &str, skip: u64) -> Result<FsdpTime, String> {
    use serde_json::Value;
    let v: Value = serde_json::from_str(trace).map_err(|e| format!("trace.json: {e}"))?;
    let events = v
        .get("traceEvents")
        .and_then(Value::as_array)
        .ok_or("trace.json: no traceEvents")?;
    let (mut comm, mut wait) = (0.0, 0.0);
    let mut ranks = std::collections::BTreeSet::new();
    let mut steps = std::collections::BTreeSet::new();
    for e in events {
        let text = |k: &str| e.get(k).and_then(Value::as_str);
        let step = e.pointer("/args/step").and_then(Value::as_u64).unwrap_or(0);
        if text("ph") != Some("X") || text("cat") != Some("fsdp.comm") || step <= skip {
            continue;
        }
        let dur = e.get("dur").and_then(Value::as_f64).unwrap_or(0.0) * 1e-6;
        ranks.insert(e.get("pid").and_then(Value::as_u64).unwrap_or(0));
        steps.insert(step);
        match text("name").unwrap_or("") {
            n if n.starts_with("wait") => wait += dur,
            "all_gather" | "reduce_scatter" => comm += dur,
            _ => {}
        }
    }
    let per = (ranks.len() * steps.len()).max(1) as f64;
    Ok(FsdpTime {
        comm_s: comm / per,
        exposed_s: wait / per,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The waits and the collectives in flight, per rank and step, past
    /// the skipped steps; other spans ignored.
    #[test]
    fn fsdp_time_sums_waits_and_collectives_per_rank_and_step() {
        let ev = |pid: u64, step: u64, name: &str, cat: &str, dur: f64| {
            format!(
                r#"{{"ph":"X","cat":"{cat}","name":"{name}","pid":{pid},"ts":0,"dur":{dur},"args":{{"step":{step}}}}}"#
            )
        };
        let events = [
            ev(0, 1, "all_gather", "fsdp.comm", 9e6),
            ev(0, 2, "all_gather", "fsdp.comm", 4000.0),
            ev(0, 2, "wait all_gather", "fsdp.comm", 1000.0),
            ev(1, 2, "reduce_scatter", "fsdp.comm", 2000.0),
            ev(1, 3, "wait reduce", "fsdp.comm", 3000.0),
            ev(1, 3, "backward", "fsdp.compute", 7e6),
        ];
        let trace = format!(r#"{{"traceEvents":[{}]}}"#, events.join(","));
        let t = fsdp_time(&trace, 1).unwrap();
        // 2 ranks x 2 steps
        assert!((t.comm_s - 6e-3 / 4.0).abs() < 1e-12, "{t:?}");
        assert!((t.exposed_s - 4e-3 / 4.0).abs() < 1e-12, "{t:?}");
        assert!(fsdp_time("{}", 0).is_err());
    }

    #[test]
    fn quoting_survives_the_shell() {
        assert_eq!(quoted("parallel.fsdp=\"full\""), "'parallel.fsdp=\"full\"'");
        assert_eq!(quoted("it's"), "'it'\\''s'");
    }
}
