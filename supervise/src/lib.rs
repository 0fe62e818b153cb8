//! The parent side of fault tolerance: run a training job as child
//! process(es), watch it, and restart it from its newest checkpoint that
//! verifies when it fails — with no person awake — as torchelastic sits
//! outside torchtitan; plus the faults to drill it with and the drill.
//!
//! # Overview
//! * [`Supervisor`] runs the job (`weft train` by default, or any command
//!   that resumes with `--resume` and writes heartbeats) as a child, or
//!   under a launcher (`--launch 'mpirun -np {n}'`, see
//!   [`Supervisor::launch`]), in a process group of its own, and restarts
//!   it with `--resume` when it exits with an error or is killed, or when
//!   a rank's heartbeat stops for longer than the heartbeat timeout (then
//!   it kills the process group first). The failed rank is the one the
//!   launcher's or the collectives' watchdog's message on stderr names
//!   (the stream is passed through), else the ranks whose heartbeat fell
//!   behind. Restarts are bounded and spaced by a backoff that doubles;
//!   with spares ([`Elastic`]) each failure uses one, and with none left
//!   the job may shrink to fewer data-parallel replicas, keeping its
//!   global batch; a failed rank's host leaves the hostfile. Each start,
//!   failure, restart and the end are appended to `<run>/events.jsonl`
//!   as [`weft_trace::RunEvent`]s ([`events`]).
//! * [`mod@heartbeat`]: the file every rank writes after every step, which
//!   the supervisor watches.
//! * [`lock`]: one writer per run folder — an exclusive lock held for
//!   the life of a run, gone with its process.
//! * [`health`]: the rank side — the loss-spike and straggler detectors a
//!   training loop feeds, and the batches a rewound run leaves out
//!   (`skip.json`).
//! * [`stop`]: the first SIGINT or SIGTERM asks for a clean stop (finish
//!   the step, save, exit), a second ends the process; a supervisor
//!   forwards it to its job and does not restart a job stopped so.
//! * [`Fault`]s (`kill:rank=1,step=37`, `hang:step=50`, `nan:step=60`,
//!   `spike:step=45`, `slow:rank=1,factor=3`,
//!   `corrupt-checkpoint:step=40`, `crash-during-save:step=80`) are for
//!   tests and drills: the supervisor passes them to the first attempt
//!   only, so a restarted run goes on fault-free. The ranks fire them
//!   (the trainer's fault plan).
//! * [`Drill`] (`weft chaos`): a small job run fault-free, then trials of
//!   random faults under supervision, each checked for detection,
//!   recovery, the time lost and the bits of the fault-free run.
//!
//! ```no_run
//! use std::time::Duration;
//! use weft_supervise::{Elastic, Supervisor};
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
//! # Ok::<(), weft_supervise::SuperviseError>(())
//! ```
//!
//! # Crate features
//! None. Unix only (process groups and signals).

#![deny(missing_docs)]

mod chaos;
mod cluster;
pub mod events;
mod fault;
pub mod health;
pub mod heartbeat;
pub mod lock;
pub mod stop;
mod supervisor;

pub use chaos::{
    ChaosError, DRILL_FAULTS, Drill, DrillJob, Trial, table_header, table_row, table_totals,
};
pub use cluster::{DrillCluster, NodeFault, NodeFaultKind};
pub use fault::{Fault, FaultKind};
pub use heartbeat::{heartbeat, host_name};

/// Makes `cmd`'s process receive `signal` when this process dies, however
/// it dies (SIGKILL included): Linux's parent-death signal. A child
/// started after this process already died exits at once. The signal is
/// tied to the thread that spawns the child, so spawn from a thread that
/// lives as long as the child should.
pub fn die_with_parent(cmd: &mut std::process::Command, signal: libc::c_int) {
    use std::os::unix::process::CommandExt;
    // SAFETY: `getpid` has no preconditions
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure calls only async-signal-safe functions (prctl,
    // getppid) between fork and exec
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // the parent died before the signal was armed
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}
pub use supervisor::{Elastic, Outcome, SuperviseError, Supervisor};
