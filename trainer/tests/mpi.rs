//! `mpirun weft train`: one process per rank over the MPI backend, against
//! the same job on thread ranks (feature `mpi`).
//!
//! Each test runs the `weft` binary twice — once as threads of one process,
//! once as `mpirun --oversubscribe -np N weft train` — and compares the runs'
//! `metrics.jsonl` bit for bit (losses, gradient norms, validation losses
//! as JSON text, which round-trips f64). The failure tests kill or stop
//! one rank of a running job and check that the job ends, non-zero, with
//! nothing left running. Skipped, with a printed reason (`SKIPPED: ...`,
//! counted as a skip by the test command, where `WEFT_REQUIRE_ALL=1` makes
//! it a failure), where `mpirun` is missing (`WEFT_MPIRUN` names another
//! launcher).
#![allow(clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One job at a time: the machine has few cores and the failure tests
/// time their jobs.
static SERIAL: Mutex<()> = Mutex::new(());

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn launcher() -> Option<String> {
    let l = std::env::var("WEFT_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let found = Command::new(&l)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        Some(l)
    } else {
        assert!(
            std::env::var_os("WEFT_REQUIRE_ALL").is_none(),
            "`{l} --version` does not run, and WEFT_REQUIRE_ALL is set"
        );
        // past the harness's capture: shown, and counted as a skip
        let msg = format!("SKIPPED: `{l} --version` does not run (install openmpi-bin)\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), msg.as_bytes());
        None
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small job's settings.
fn job(dir: &Path, name: &str, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut sets: Vec<String> = [
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=8",
        "train.micro_batch_size=2",
        "train.eval_every=3",
        "train.eval_sequences=6",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "checkpoint.every=0",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    sets.push(format!("train.steps={steps}"));
    sets.extend(extra.iter().map(|s| (*s).to_owned()));
    sets.push(format!("run.dir={:?}", dir.display().to_string()));
    sets.push(format!("run.name={name}"));
    sets.into_iter().flat_map(|s| ["--set".into(), s]).collect()
}

/// `weft train` on thread ranks.
fn threads(args: &[String]) -> Output {
    Command::new(WEFT).arg("train").args(args).output().unwrap()
}

/// `mpirun -np N weft train`.
fn mpirun(launcher: &str, np: usize) -> Command {
    let mut c = Command::new(launcher);
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "-np", &np.to_string(), WEFT, "train"]);
    c
}

fn processes(launcher: &str, np: usize, args: &[String]) -> Output {
    mpirun(launcher, np).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Every metrics line's step, loss, gradient norm and validation loss.
fn metrics(run: &Path) -> Vec<String> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_else(|e| panic!("{}: {e}", run.display()))
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!(
                "{} {} {} {}",
                v["step"], v["loss"], v["grad_norm"], v["val_loss"]
            )
        })
        .collect()
}

#[test]
fn every_axis_over_processes_equals_the_thread_ranks_bit_for_bit() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("layouts");
    let moe = [
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "parallel.dp=2",
        "parallel.ep=2",
    ];
    let cp = ["model.block_size=256", "parallel.cp=2"];
    let cp_fsdp = [
        "model.block_size=256",
        "parallel.cp=2",
        "parallel.dp=2",
        "parallel.fsdp=\"full\"",
    ];
    let layouts: [(&str, usize, &[&str]); 11] = [
        ("cp2", 2, &cp),
        ("cp2dp2-fsdp", 4, &cp_fsdp),
        ("dp2", 2, &["parallel.dp=2"]),
        ("fsdp2", 2, &["parallel.dp=2", "parallel.fsdp=\"full\""]),
        (
            "tp2",
            2,
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
        ("pp2", 2, &["parallel.pp=2"]),
        ("ep2", 2, &moe),
        (
            "dp4-plain",
            4,
            &["parallel.dp=4", "parallel.reproducible=false"],
        ),
        ("dp2tp2", 4, &["parallel.dp=2", "parallel.tp=2"]),
        (
            "pp2dp2-zero1",
            4,
            &[
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.fsdp=\"optimizer\"",
            ],
        ),
        ("pp2tp2", 4, &["parallel.pp=2", "parallel.tp=2"]),
    ];
    for (name, np, sets) in layouts {
        let t = threads(&job(&dir, &format!("{name}-threads"), 6, sets));
        assert!(t.status.success(), "{name} on threads:\n{}", text(&t));
        let p = processes(&l, np, &job(&dir, &format!("{name}-mpi"), 6, sets));
        let out = text(&p);
        assert!(p.status.success(), "{name} over {np} processes:\n{out}");
        assert!(
            out.contains(&format!("{np} processes over mpi")) && out.contains("rank 0: pp 0"),
            "{name}: the start-up report names the backend and the ranks' hosts:\n{out}"
        );
        let (a, b) = (
            metrics(&dir.join(format!("{name}-threads"))),
            metrics(&dir.join(format!("{name}-mpi"))),
        );
        assert_eq!(a.len(), 9, "{name}: 6 steps and 3 evaluations");
        if name.ends_with("-plain") {
            // plain sums over MPI are the library's MPI_Allreduce, in its
            // own order: equal within rounding, not bitwise
            assert_eq!(a.len(), b.len(), "{name}: records");
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(
                    x.split(' ').count(),
                    y.split(' ').count(),
                    "{name}: {x} vs {y}"
                );
                for (u, v) in x.split(' ').zip(y.split(' ')) {
                    let (u, v) = (u.parse::<f64>(), v.parse::<f64>());
                    if let (Ok(u), Ok(v)) = (u, v) {
                        assert!(
                            (u - v).abs() <= 1e-6 * u.abs().max(1.0),
                            "{name}: {x} vs {y}"
                        );
                    }
                }
            }
        } else {
            assert_eq!(a, b, "{name}: threads vs {np} MPI processes");
        }
        // only rank 0 writes the run folder's logs; the trace holds every
        // rank's lanes
        let trace = std::fs::read_to_string(dir.join(format!("{name}-mpi/trace.json"))).unwrap();
        for r in 0..np {
            assert!(
                trace.contains(&format!("\"rank {r}: ")),
                "{name}: rank {r} in trace.json"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_saved_by_processes_resumes_on_threads_and_back() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("resume");
    // a constant learning rate, so that stopping early (train.steps=2, then
    // 4) leaves the schedule of the 6-step run unchanged
    let layout = [
        "parallel.dp=2",
        "parallel.fsdp=\"full\"",
        "checkpoint.every=2",
        "optim.warmup_steps=0",
        "optim.min_lr_ratio=1.0",
    ];
    let whole = threads(&job(&dir, "whole", 6, &layout));
    assert!(whole.status.success(), "{}", text(&whole));
    // 2 steps over processes (each rank writes its own shards) ...
    let first = processes(&l, 2, &job(&dir, "split", 2, &layout));
    assert!(first.status.success(), "{}", text(&first));
    let shards: Vec<_> = std::fs::read_dir(dir.join("split/checkpoints/step-00000002"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(shards.len(), 2, "one shard file per rank: {shards:?}");
    // ... 2 more on threads, then the last 2 over processes again
    let run = dir.join("split").display().to_string();
    let resume = |steps: u64| {
        vec![
            "--resume".to_owned(),
            run.clone(),
            "--set".into(),
            format!("train.steps={steps}"),
        ]
    };
    let second = threads(&resume(4));
    assert!(second.status.success(), "{}", text(&second));
    let third = processes(&l, 2, &resume(6));
    assert!(third.status.success(), "{}", text(&third));
    // the same steps (the stopped runs evaluate at their last step too)
    let steps = |run: &str| -> Vec<String> {
        metrics(&dir.join(run))
            .into_iter()
            .filter(|l| l.ends_with(" null"))
            .collect()
    };
    assert_eq!(steps("split").len(), 6);
    assert_eq!(steps("split"), steps("whole"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn text_is_tokenized_once_and_read_by_every_process() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("text");
    let corpus = dir.join("corpus.txt");
    let text_body: String = (0..400)
        .map(|i| format!("Line {i} of a small corpus, with words that repeat. "))
        .collect();
    std::fs::write(&corpus, text_body).unwrap();
    let cache = dir.join("cache");
    let data = format!("data.source={:?}", corpus.display().to_string());
    let sets = [
        data.as_str(),
        "parallel.dp=2",
        "model.n_embd=16",
        "model.n_head=2",
    ];
    let p = mpirun(&l, 2)
        .env("WEFT_CACHE", &cache)
        .args(job(&dir, "mpi", 3, &sets))
        .output()
        .unwrap();
    assert!(p.status.success(), "{}", text(&p));
    let cached: Vec<_> = std::fs::read_dir(cache.join("tokens"))
        .unwrap()
        .filter_map(|e| e.ok())
        .collect();
    assert_eq!(cached.len(), 1, "one token cache file, no temporaries");
    let t = Command::new(WEFT)
        .env("WEFT_CACHE", dir.join("cache-threads"))
        .arg("train")
        .args(job(&dir, "threads", 3, &sets))
        .output()
        .unwrap();
    assert!(t.status.success(), "{}", text(&t));
    assert_eq!(metrics(&dir.join("mpi")), metrics(&dir.join("threads")));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn set_up_errors_are_reported_once_and_every_process_exits() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("errors");
    let cases: [(&str, usize, &[&str], &str); 5] = [
        (
            "bad-config",
            4,
            &["parallel.dp=4", "parallel.tp=3"],
            "must divide the model's heads",
        ),
        (
            "world-size",
            2,
            &["parallel.dp=4"],
            "the layout needs 4 ranks (parallel.dp · cp · tp · pp = 4 · 1 · 1 · 1) but Open MPI started 2 process(es)",
        ),
        (
            "threads-forced",
            2,
            &["parallel.dp=2", "parallel.backend=\"threads\""],
            "\"threads\" runs every rank in one process",
        ),
        ("unknown-key", 2, &["parallel.nonsense=1"], "unknown key"),
        (
            "nccl",
            2,
            &["parallel.dp=2", "parallel.backend=\"nccl\""],
            // the typed "not available" error where there is no GPU
            if cfg!(feature = "nccl") {
                "nccl backend not available"
            } else {
                "built without NCCL support"
            },
        ),
    ];
    for (name, np, sets, expected) in cases {
        let started = Instant::now();
        let p = processes(&l, np, &job(&dir, name, 2, sets));
        let out = text(&p);
        assert!(!p.status.success(), "{name}: {out}");
        assert_eq!(
            out.matches(expected).count(),
            1,
            "{name}: said once, by one rank:\n{out}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{name}: no process waits"
        );
    }
    // the run folder exists: said once, and the folder is untouched
    let ok = processes(&l, 2, &job(&dir, "exists", 2, &["parallel.dp=2"]));
    assert!(ok.status.success(), "{}", text(&ok));
    let before = std::fs::read(dir.join("exists/metrics.jsonl")).unwrap();
    let again = processes(&l, 2, &job(&dir, "exists", 2, &["parallel.dp=2"]));
    let out = text(&again);
    assert!(!again.status.success());
    assert_eq!(out.matches("already exists").count(), 1, "{out}");
    assert_eq!(
        std::fs::read(dir.join("exists/metrics.jsonl")).unwrap(),
        before
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pids of the `weft` processes `mpirun` started.
fn ranks_of(job: &Child) -> Vec<u32> {
    let out = Command::new("pgrep")
        .args(["-P", &job.id().to_string()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn alive(pid: u32) -> bool {
    // a zombie (exited, not yet reaped) counts as gone
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// Starts a long 4-process job and waits until it trains. The caller
/// waits for it ([`finish`]).
#[allow(clippy::zombie_processes)]
fn start_long_job(l: &str, dir: &Path, name: &str, timeout_s: u32) -> (Child, Vec<u32>) {
    let timeout = format!("parallel.timeout_s={timeout_s}");
    let sets = ["parallel.dp=4", "train.eval_every=0", timeout.as_str()];
    let mut child = mpirun(l, 4)
        .args(job(dir, name, 1_000_000, &sets))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join(name).join("metrics.jsonl");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let lines = std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count());
        let ranks = ranks_of(&child);
        if lines >= 3 && ranks.len() == 4 {
            return (child, ranks);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the job did not start training");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for the job to end (killing it after `limit`); its status and
/// stderr.
fn finish(mut child: Child, limit: Duration) -> (Option<i32>, String, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            return (status.code(), err, started.elapsed());
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the job did not end within {limit:?} after a rank failed");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_killed_rank_ends_the_whole_job() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("kill");
    let (child, ranks) = start_long_job(&l, &dir, "killed", 300);
    let victim = ranks[2];
    Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    let (code, err, took) = finish(child, Duration::from_secs(60));
    assert_ne!(code, Some(0), "mpirun exits non-zero:\n{err}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    std::thread::sleep(Duration::from_millis(500));
    let left: Vec<_> = ranks.iter().filter(|&&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left running: {left:?}\n{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hung_rank_makes_the_others_time_out_naming_it() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("hang");
    let (child, ranks) = start_long_job(&l, &dir, "hung", 4);
    // stopped, not dead: only the watchdog can tell
    Command::new("kill")
        .args(["-STOP", &ranks[1].to_string()])
        .status()
        .unwrap();
    let (code, err, took) = finish(child, Duration::from_secs(90));
    for &p in &ranks {
        let _ = Command::new("kill")
            .args(["-CONT", &p.to_string()])
            .status();
    }
    assert_ne!(code, Some(0), "mpirun exits non-zero:\n{err}");
    assert!(
        err.contains("timed out after 4s") && err.contains("did not arrive"),
        "a rank names the operation and the missing ranks:\n{err}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let left: Vec<_> = ranks.iter().filter(|&&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left running: {left:?}\n{err}");
    eprintln!("a hung rank: the job ended {took:?} after it stopped");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hostfile_launch_runs_as_documented() {
    let Some(l) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("hostfile");
    // README's two-node example, on the one node there is
    let hosts = dir.join("hosts.txt");
    std::fs::write(&hosts, "# hosts.txt\nlocalhost slots=4\n").unwrap();
    let p = Command::new(&l)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["-np", "4", "--hostfile"])
        .arg(&hosts)
        .args(["--map-by", "slot", WEFT, "train"])
        .args(job(&dir, "hosts", 3, &["parallel.tp=2", "parallel.dp=2"]))
        .output()
        .unwrap();
    let out = text(&p);
    assert!(p.status.success(), "{out}");
    assert!(
        out.contains("4 processes over mpi")
            && out.contains("1 node: ")
            && !out.contains("warning"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cluster of network-namespace nodes made by `scripts/cluster.sh`,
/// taken down when dropped.
struct Cluster {
    name: String,
    /// The `mpirun` prefix `up` printed on its last line.
    prefix: Vec<String>,
}

fn cluster_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster.sh")
}

impl Cluster {
    /// `cluster.sh up --nodes N --link RATE`, or `None` (a printed skip)
    /// where this machine cannot make network namespaces (not root, or no
    /// `ip`/`unshare`).
    fn up(nodes: usize, link: &str) -> Option<Cluster> {
        let can = Command::new("unshare")
            .args(["--net", "true"])
            .status()
            .is_ok_and(|s| s.success())
            && Command::new("ip")
                .arg("-V")
                .output()
                .is_ok_and(|o| o.status.success());
        if !can {
            assert!(
                std::env::var_os("WEFT_REQUIRE_ALL").is_none(),
                "network namespaces cannot be made here, and WEFT_REQUIRE_ALL is set"
            );
            let msg = "SKIPPED: network namespaces cannot be made here (needs root, iproute2)\n";
            let _ = std::io::Write::write_all(&mut std::io::stderr(), msg.as_bytes());
            return None;
        }
        let name = format!("t{}", std::process::id() % 10_000_000);
        let o = Command::new("bash")
            .arg(cluster_script())
            .args(["up", "--name", &name, "--nodes", &nodes.to_string()])
            .args(["--link", link])
            .output()
            .unwrap();
        let out = text(&o);
        assert!(o.status.success(), "cluster.sh up:\n{out}");
        let last = String::from_utf8_lossy(&o.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .to_owned();
        assert!(
            last.contains("mpirun"),
            "up's last line is the prefix:\n{out}"
        );
        Some(Cluster {
            name,
            prefix: last.split_whitespace().map(str::to_owned).collect(),
        })
    }

    fn script(&self, args: &[&str]) -> Output {
        Command::new("bash")
            .arg(cluster_script())
            .args(args)
            .args(["--name", &self.name])
            .output()
            .unwrap()
    }

    /// `PREFIX -np N --map-by slot weft train`.
    fn mpirun(&self, np: usize) -> Command {
        let mut c = Command::new(&self.prefix[0]);
        c.args(&self.prefix[1..])
            .args(["-np", &np.to_string(), "--map-by", "slot", WEFT, "train"]);
        c
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let o = self.script(&["down"]);
        assert!(o.status.success(), "cluster.sh down:\n{}", text(&o));
    }
}

#[test]
fn across_namespace_nodes_layouts_equal_the_thread_ranks_bit_for_bit() {
    let Some(_) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(cluster) = Cluster::up(2, "1gbit") else {
        return;
    };
    let dir = tmp("cluster");
    // tp inside a node, dp across; FSDP over all four ranks; stages
    // across nodes
    let layouts: [(&str, &[&str]); 3] = [
        ("dp2tp2", &["parallel.dp=2", "parallel.tp=2"]),
        ("fsdp4", &["parallel.dp=4", "parallel.fsdp=\"full\""]),
        ("pp2dp2", &["parallel.pp=2", "parallel.dp=2"]),
    ];
    for (name, sets) in layouts {
        let t = threads(&job(&dir, &format!("{name}-threads"), 6, sets));
        assert!(t.status.success(), "{name} on threads:\n{}", text(&t));
        let p = cluster
            .mpirun(4)
            .args(job(&dir, &format!("{name}-nodes"), 6, sets))
            .output()
            .unwrap();
        let out = text(&p);
        assert!(p.status.success(), "{name} across nodes:\n{out}");
        assert!(
            out.contains("4 processes over mpi") && out.contains("2 nodes: n0 [0-1], n1 [2-3]"),
            "{name}: the start-up report shows which ranks share a node:\n{out}"
        );
        assert_eq!(
            metrics(&dir.join(format!("{name}-threads"))),
            metrics(&dir.join(format!("{name}-nodes"))),
            "{name}: threads vs 4 processes on 2 nodes"
        );
    }
    let status = text(&cluster.script(&["status"]));
    assert!(
        status.contains("n1: 10.213.0.2/24 link UP, 0 process(es)"),
        "{status}"
    );
    calibrates_on_the_cluster(&cluster);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft plan --calibrate --launch PREFIX` on a two-node cluster of 1
/// Gbit/s links: the links measured (between nodes about the link's rate,
/// inside a node several times it), every layout across nodes run and
/// predicted, the crossover over 1 and 2 nodes with FSDP's exposed
/// communication read from the trace.
fn calibrates_on_the_cluster(cluster: &Cluster) {
    let o = Command::new(WEFT)
        .args(["plan", "--calibrate", "--launch", &cluster.prefix.join(" ")])
        .args([
            "--nodes",
            "2",
            "--calibrate-steps",
            "5",
            "--calibrate-rounds",
            "1",
        ])
        .arg("--json")
        .args(job(&tmp("calibrate"), "calibrate", 5, &[]))
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "plan --calibrate --launch:\n{out}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let net = &v["network"];
    let node = net["node"]["bandwidth"].as_f64().unwrap();
    let intra = net["intra"]["bandwidth"].as_f64().unwrap();
    // 1 Gbit/s is 125 MB/s; TCP through the switch reaches about 0.96
    assert!(
        (60e6..=130e6).contains(&node),
        "between nodes {node} B/s:\n{out}"
    );
    assert!(
        intra > 2.0 * node,
        "in a node {intra} B/s, between {node}:\n{out}"
    );
    let rows = v["layouts"].as_array().unwrap();
    let sets: Vec<String> = rows.iter().map(|r| r["sets"].to_string()).collect();
    for want in [
        "parallel.dp=2",
        "hybrid_shard=2",
        "parallel.pp=2",
        "parallel.tp=2",
    ] {
        assert!(sets.iter().any(|s| s.contains(want)), "{want} in {sets:?}");
    }
    for r in rows {
        let e = r["step_error"].as_f64().unwrap();
        assert!(e.is_finite() && e > -1.0, "{r}");
        assert!(r["per_node"].as_u64().unwrap() >= 1, "{r}");
    }
    let cross = v["crossover"].as_array().unwrap();
    let nodes: Vec<u64> = cross.iter().map(|r| r["nodes"].as_u64().unwrap()).collect();
    assert_eq!(nodes, [1, 2], "{out}");
    assert_eq!(cross[0]["measured_exposed_s"].as_f64(), Some(0.0), "{out}");
    assert!(
        cross[1]["measured_exposed_s"].as_f64().unwrap() > 0.0,
        "{out}"
    );
    assert!(
        cross[1]["predicted_exposed_s"].as_f64().unwrap() > 0.0,
        "{out}"
    );
}

/// A fault done to the cluster once a supervised job is past a step, and
/// what the restart it causes must show.
struct NodeFault {
    /// The step the job must be past.
    after_step: u64,
    /// What is done to the cluster.
    fault: Box<dyn FnOnce(&Cluster)>,
    /// The node the failure names (and the restart leaves out).
    host: &'static str,
    /// The restart's `excluded_hosts`.
    excluded: &'static [&'static str],
    /// The restart's `action`.
    action: &'static str,
    /// The start-up report's node line of the attempt after it.
    nodes: &'static str,
}

/// A supervised data-parallel job over 4 ranks on nodes n0 and n1 of a
/// three-node cluster (n2 spare, `--spares 1`) with each of `faults`
/// done to the cluster in turn: it ends with the fault-free run's bits,
/// after one restart per fault, each as the fault says.
fn supervised_across_nodes_survives(case: &str, faults: Vec<NodeFault>) {
    let Some(_) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(cluster) = Cluster::up(3, "1gbit") else {
        return;
    };
    let dir = tmp(case);
    let extra = [
        "parallel.dp=4",
        "checkpoint.every=40",
        "train.eval_every=40",
        "parallel.timeout_s=10",
    ];
    // long enough that the job is still training when a fault lands
    // (its steps take milliseconds, and its saves do not stop it)
    let reference = threads(&job(&dir, "reference", 320, &extra));
    assert!(reference.status.success(), "{}", text(&reference));
    let state = format!("/run/{}-cluster", cluster.name);
    let launch = std::fs::read_to_string(format!("{state}/launch")).unwrap();
    // n0 and n1 hold the four ranks; n2, last in the hostfile, is spare
    let mut job_ = Command::new(WEFT)
        .args(["train", "--supervise", "--restart-backoff", "0.1"])
        .args(["--hostfile", &format!("{state}/hostfile"), "--spares", "1"])
        .args([
            "--launch",
            &format!(
                "{} -np {{n}} --hostfile {{hostfile}} --map-by slot",
                launch.trim()
            ),
        ])
        .args(job(&dir, "supervised", 320, &extra))
        .stdout(std::fs::File::create(dir.join("out.log")).unwrap())
        .stderr(std::fs::File::create(dir.join("err.log")).unwrap())
        .spawn()
        .unwrap();
    let metrics_file = dir.join("supervised/metrics.jsonl");
    let t0 = Instant::now();
    let mut expected = Vec::new();
    for f in faults {
        let mark = format!("\"step\":{},", f.after_step);
        while !std::fs::read_to_string(&metrics_file).is_ok_and(|m| m.contains(&mark)) {
            assert!(
                t0.elapsed() < Duration::from_secs(400),
                "{case}: the supervised job never reached step {}",
                f.after_step
            );
            assert!(
                job_.try_wait().unwrap().is_none(),
                "{case}: the job ended early"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        (f.fault)(&cluster);
        expected.push((f.host, f.excluded, f.action, f.nodes));
    }
    let (code, _, _) = finish(job_, Duration::from_secs(300));
    let out = std::fs::read_to_string(dir.join("out.log")).unwrap()
        + &std::fs::read_to_string(dir.join("err.log")).unwrap();
    assert_eq!(code, Some(0), "{case}: {out}");
    let ev = events(&dir.join("supervised"));
    let of = |kind: &str| -> Vec<&serde_json::Value> {
        ev.iter().filter(|e| e["event"] == kind).collect()
    };
    let (failures, restarts) = (of("failure"), of("restart"));
    assert_eq!(restarts.len(), expected.len(), "{case}: {ev:?}");
    // each attempt's start-up report, in order: which nodes it ran on
    let reports: Vec<&str> = out
        .lines()
        .filter_map(|l| l.find("2 nodes: ").map(|i| &l[i..]))
        .collect();
    assert_eq!(reports.len(), 1 + expected.len(), "{case}:\n{out}");
    assert!(
        reports[0].starts_with("2 nodes: n0 [0-1], n1 [2-3]"),
        "{case}:\n{out}"
    );
    for (i, (host, excluded, action, nodes)) in expected.into_iter().enumerate() {
        assert_eq!(
            failures[i]["host"], host,
            "{case}: failure {i} names node {host}, as mpirun names it: {ev:?}"
        );
        assert_eq!(
            restarts[i]["excluded_hosts"],
            serde_json::json!(excluded),
            "{case}: restart {i}: {ev:?}"
        );
        assert_eq!(restarts[i]["action"], action, "{case}: restart {i}: {ev:?}");
        assert!(
            reports[i + 1].starts_with(nodes),
            "{case}: restart {i} runs on {nodes}:\n{out}"
        );
    }
    assert_eq!(
        metrics(&dir.join("supervised")),
        metrics(&dir.join("reference")),
        "{case}: the fault-free run's bits"
    );
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `cluster.sh ARGS` done to the cluster, which must succeed.
fn cluster_does(args: &'static [&'static str]) -> Box<dyn FnOnce(&Cluster)> {
    Box::new(move |c: &Cluster| {
        let o = c.script(args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    })
}

#[test]
fn a_dead_node_is_replaced_by_the_spare_and_is_a_spare_again_once_revived() {
    // node n1 dies (its processes killed, its link down): the spare n2
    // takes over. n1 comes back; then n2 dies: the supervisor finds n1
    // answering again and runs on it
    supervised_across_nodes_survives(
        "dead-node",
        vec![
            NodeFault {
                after_step: 50,
                fault: cluster_does(&["kill-node", "n1"]),
                host: "n1",
                excluded: &["n1"],
                action: "a spare took over (0 left)",
                nodes: "2 nodes: n0 [0-1], n2 [2-3]",
            },
            NodeFault {
                after_step: 100,
                fault: Box::new(|c: &Cluster| {
                    let o = c.script(&["revive", "n1"]);
                    assert!(o.status.success(), "revive: {}", text(&o));
                    let o = c.script(&["kill-node", "n2"]);
                    assert!(o.status.success(), "kill-node n2: {}", text(&o));
                }),
                host: "n2",
                excluded: &["n2"],
                action: "n1 back: a spare took over (0 left)",
                nodes: "2 nodes: n0 [0-1], n1 [2-3]",
            },
        ],
    );
}

/// `weft chaos --cluster`: a node killed and a link flapped (down 10 to
/// 20 s, longer than the drill's `parallel.timeout_s` of 5 s, so the
/// attempt fails rather than rides through) in a data-parallel job over
/// nodes n0 and n1, n2 spare: each detected, naming the node, recovered
/// on the spare node, and bitwise the fault-free run; the killed node is
/// revived after its trial.
#[test]
fn weft_chaos_kills_nodes_and_flaps_links_on_the_cluster() {
    let Some(_) = launcher() else { return };
    let _g = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(cluster) = Cluster::up(3, "1gbit") else {
        return;
    };
    let dir = tmp("chaos-cluster");
    let o = Command::new(WEFT)
        .args(["chaos", "--cluster", &cluster.name, "--trials", "2"])
        .args(["--faults", "node-kill,link-flap", "--seed", "3"])
        .args(["--set", "parallel.dp=4", "--set", "train.steps=80"])
        .args(["--set", "checkpoint.every=20"])
        .arg("--dir")
        .arg(&dir)
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "weft chaos --cluster:\n{out}");
    assert!(
        out.contains("detected 2/2, recovered 2/2, hung 0, bitwise 2/2"),
        "{out}"
    );
    let mut kinds = Vec::new();
    for trial in 0..2 {
        let row = out
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{trial}  ")))
            .unwrap_or_else(|| panic!("trial {trial}'s row:\n{out}"));
        let fault = row.split_whitespace().nth(1).unwrap();
        let (kind, rest) = fault.split_once(":node=").unwrap();
        kinds.push(kind.to_owned());
        // the node the fault was done to is the one the failure names
        let node = rest.split(',').next().unwrap();
        let ev = events(&dir.join(format!("trial-{trial}")));
        let failure = ev.iter().find(|e| e["event"] == "failure").unwrap();
        assert_eq!(failure["host"], node, "{fault}: {ev:?}");
        let restart = ev.iter().find(|e| e["event"] == "restart").unwrap();
        assert_eq!(
            restart["action"], "a spare took over (0 left)",
            "{fault}: {ev:?}"
        );
    }
    kinds.sort();
    assert_eq!(
        kinds,
        ["link-flap", "node-kill"],
        "one trial of each kind:\n{out}"
    );
    let status = text(&cluster.script(&["status"]));
    assert!(
        ["n0", "n1", "n2"]
            .iter()
            .all(|n| status.contains(&format!("{n}: 10.213.0.")) && !status.contains("link DOWN")),
        "every node back after the drill:\n{status}"
    );
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The supervisor's events of a run.
fn events(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| {
            !["fault", "running", "rewound", "straggler", "checkpoint"]
                .contains(&e["event"].as_str().unwrap_or(""))
        })
        .collect()
}

#[test]
fn a_supervised_mpirun_job_survives_a_killed_and_a_hung_rank_bit_for_bit() {
    let Some(l) = launcher() else { return };
    let _one = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tmp("supervised");
    let extra = ["parallel.dp=2", "checkpoint.every=3"];
    let reference = threads(&job(&dir, "reference", 12, &extra));
    assert!(reference.status.success(), "{}", text(&reference));
    let launch = format!("{l} --oversubscribe -np {{n}}");
    // (name, fault and options, what the restart did, data-parallel
    // degree at the end)
    let cases: [(&str, &[&str], &str, u64); 2] = [
        // rank 1's process is killed: a spare takes its place
        (
            "killed",
            &["--inject", "kill:rank=1,step=8", "--spares", "1"],
            "a spare took over (0 left)",
            2,
        ),
        // rank 1 hangs: rank 0's watchdog names it; with no spare the job
        // goes on with one data-parallel replica, the global batch kept
        (
            "hung",
            &["--inject", "hang:rank=1,step=5", "--shrink"],
            "no spare left: continuing on parallel.dp = 1 (was 2), the global batch kept by accumulation",
            1,
        ),
    ];
    for (name, options, action, dp) in cases {
        let out = Command::new(WEFT)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .args(["train", "--supervise", "--restart-backoff", "0.1"])
            .args(["--heartbeat-timeout", "60", "--launch", &launch])
            .args(options)
            .args(job(
                &dir,
                name,
                12,
                &[extra[0], extra[1], "parallel.timeout_s=3"],
            ))
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {}", text(&out));
        let ev = events(&dir.join(name));
        let kinds: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["start", "failure", "restart", "start", "finished"],
            "{name}: {ev:?}"
        );
        assert_eq!(ev[1]["rank"], 1, "{name}: {ev:?}");
        if name == "killed" {
            // the node, as mpirun names it
            assert!(
                ev[1]["host"].as_str().is_some_and(|h| !h.is_empty()),
                "{ev:?}"
            );
        }
        assert_eq!(ev[2]["action"], action, "{name}");
        assert_eq!(ev[4]["dp"], dp, "{name}");
        // the final state is the fault-free run's: data-parallel layouts
        // are bitwise-equivalent
        assert_eq!(
            metrics(&dir.join(name)),
            metrics(&dir.join("reference")),
            "{name}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
