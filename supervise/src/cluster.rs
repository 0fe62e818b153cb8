//! Faults of nodes and links for [`Drill`](crate::Drill), done to a
//! cluster of network namespaces made by `scripts/cluster.sh`: a node
//! that dies (every process on it killed, its link down) and a link that
//! goes down for some seconds and comes back (a flap).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::chaos::ChaosError;

/// A cluster made by `scripts/cluster.sh up --name NAME`, read from its
/// state folder `/run/NAME-cluster`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrillCluster {
    /// Its name (`cluster.sh --name`).
    pub name: String,
    /// Its state folder: `hostfile`, `launch`, `script`.
    pub state: PathBuf,
    /// Its nodes in hostfile order, each with its slots.
    pub nodes: Vec<(String, usize)>,
}

impl DrillCluster {
    /// The cluster named `name`, which must be up.
    ///
    /// # Errors
    /// [`ChaosError::Cluster`] when it is not up or its state folder lacks
    /// a file `cluster.sh up` writes.
    pub fn open(name: &str) -> Result<Self, ChaosError> {
        let state = PathBuf::from(format!("/run/{name}-cluster"));
        let bad = |why: String| ChaosError::Cluster(format!("cluster '{name}': {why}"));
        let hostfile = weft_trace::input::read_to_string(
            state.join("hostfile"),
            weft_trace::input::CONFIG_BYTES,
        )
        .map_err(|e| {
            bad(format!(
                "{e} (is it up? scripts/cluster.sh up --name {name})"
            ))
        })?;
        let nodes: Vec<(String, usize)> = hostfile
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                let host = w.next()?.to_owned();
                let slots = w
                    .find_map(|x| x.strip_prefix("slots=")?.parse().ok())
                    .unwrap_or(1);
                Some((host, slots))
            })
            .collect();
        if nodes.len() < 2 {
            return Err(bad(format!(
                "{} node(s) in {}: node faults need two or more",
                nodes.len(),
                state.join("hostfile").display()
            )));
        }
        for f in ["launch", "script"] {
            if !state.join(f).is_file() {
                return Err(bad(format!(
                    "no {} (made by an older scripts/cluster.sh? take it down and up again)",
                    state.join(f).display()
                )));
            }
        }
        Ok(DrillCluster {
            name: name.to_owned(),
            state,
            nodes,
        })
    }

    /// Its hostfile.
    #[must_use]
    pub fn hostfile(&self) -> PathBuf {
        self.state.join("hostfile")
    }

    /// The `--launch` of a supervised job on it: its `mpirun` prefix with
    /// `-np {n} --hostfile {hostfile} --map-by slot`.
    ///
    /// # Errors
    /// [`ChaosError::Io`] when the prefix cannot be read.
    pub fn launch(&self) -> Result<String, ChaosError> {
        let path = self.state.join("launch");
        let prefix = weft_trace::input::read_to_string(&path, weft_trace::input::CONFIG_BYTES)
            .map_err(|source| ChaosError::Io { path, source })?;
        Ok(format!(
            "{} -np {{n}} --hostfile {{hostfile}} --map-by slot",
            prefix.trim()
        ))
    }

    /// The nodes a job of `ranks` ranks runs on (the first in hostfile
    /// order), or an error when no node is left over as its spare.
    ///
    /// # Errors
    /// [`ChaosError::Cluster`] when the ranks leave no whole node spare.
    pub fn busy_nodes(&self, ranks: usize) -> Result<usize, ChaosError> {
        let mut held = 0;
        for (i, (_, slots)) in self.nodes.iter().enumerate() {
            if held >= ranks {
                return Ok(i);
            }
            held += slots;
        }
        Err(ChaosError::Cluster(format!(
            "cluster '{}': {} rank(s) over its {} node(s) ({} slot(s)) leave no node spare; \
             node faults need one (scripts/cluster.sh up --nodes {})",
            self.name,
            ranks,
            self.nodes.len(),
            self.nodes.iter().map(|n| n.1).sum::<usize>(),
            self.nodes.len() + 1
        )))
    }

    /// `cluster.sh ARGS --name NAME`, with the script `up` recorded.
    ///
    /// # Errors
    /// [`ChaosError::Cluster`] when it cannot run or fails.
    pub fn run(&self, args: &[&str]) -> Result<(), ChaosError> {
        let script = script_of(&self.state)?;
        let out = Command::new("bash")
            .arg(&script)
            .args(args)
            .args(["--name", &self.name])
            .output()
            .map_err(|source| ChaosError::Io {
                path: script.clone(),
                source,
            })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(ChaosError::Cluster(format!(
                "cluster.sh {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }
}

/// The `cluster.sh` that made the cluster whose state is `state`.
fn script_of(state: &Path) -> Result<PathBuf, ChaosError> {
    let path = state.join("script");
    weft_trace::input::read_to_string(&path, weft_trace::input::CONFIG_BYTES)
        .map(|s| PathBuf::from(s.trim()))
        .map_err(|source| ChaosError::Io { path, source })
}

/// What a [`NodeFault`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeFaultKind {
    /// Every process on the node killed and its link down at once (a node
    /// that loses power); brought back, a fresh namespace in its place,
    /// after the trial.
    NodeKill,
    /// The node's link down for some seconds, then up (a flapping switch
    /// port); its processes live on.
    LinkFlap,
}

impl NodeFaultKind {
    /// The name the drill's `--faults` and its table use.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            NodeFaultKind::NodeKill => "node-kill",
            NodeFaultKind::LinkFlap => "link-flap",
        }
    }
}

/// A fault of a node or its link, done by the drill once the job is past
/// a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFault {
    /// What happens.
    pub kind: NodeFaultKind,
    /// The node (`n1`).
    pub node: String,
    /// The step (1-based) the job must have finished first.
    pub step: u64,
    /// How long the link stays down (a flap).
    pub seconds: u64,
}

impl std::fmt::Display for NodeFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:node={},step={}",
            self.kind.name(),
            self.node,
            self.step
        )?;
        if self.kind == NodeFaultKind::LinkFlap {
            write!(f, ",seconds={}", self.seconds)?;
        }
        Ok(())
    }
}

/// The last step `run`'s `metrics.jsonl` records, if any.
pub(crate) fn last_step(run: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<weft_trace::MetricsRecord>(l).ok())
        .map(|r| r.step)
        .next()
}
