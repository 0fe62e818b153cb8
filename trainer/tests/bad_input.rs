//! Bad input, one case per line: each command gets a clear error naming
//! what was wrong and where (a non-zero exit, the expected words on
//! stderr, no panic), or the documented recovery. A new case is one line
//! of `CASES`.
//!
//! Cases needing more than a command line live beside the code they
//! exercise: checkpoint corruption of every file and field
//! (checkpoint/tests/it/corrupt.rs, fuzz targets in checkpoint/fuzz), the
//! token cache (trainer's data tests), signals and killed runs
//! (tests/train.rs), the viewer's server (weft-viz's serve tests).

use std::path::Path;
use std::process::Command;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Files the cases refer to, written into the case folder first.
const FILES: &[(&str, &[u8])] = &[
    ("badtype.toml", b"[train]\nsteps = \"ten\"\n"),
    ("badsyntax.toml", b"[train\nsteps = 1\n"),
    ("badsection.toml", b"[trian]\nsteps = 1\n"),
    ("empty.txt", b""),
    ("notutf8.toml", b"[train]\nsteps = \xff\xfe\n"),
    ("hosts.txt", b"localhost slots=2\n"),
    (
        "bigrun/config.toml",
        b"[model]\nn_embd = 65536\nn_head = 1\n",
    ),
    (
        "blend_inf.toml",
        b"[[data.blend]]\npath = \"a\"\nweight = 1e308\n[[data.blend]]\npath = \"b\"\nweight = 1e308\n",
    ),
    (
        "blend_tiny.toml",
        b"[[data.blend]]\npath = \"a\"\nweight = 1e-300\n[[data.blend]]\npath = \"b\"\nweight = 1\n",
    ),
];

/// (arguments, words the error must contain).
const CASES: &[(&[&str], &str)] = &[
    // --set and config files: the key, its place and what it expects
    (
        &["train", "--set", "train.steps=-1"],
        "key `train.steps`: invalid value: integer `-1`, expected u64",
    ),
    (
        &["train", "--set", "train.stepz=1"],
        "key `train.stepz`: unknown key; known keys here: batch_size",
    ),
    (&["train", "--set", "nokey"], "expected KEY=VALUE"),
    (
        &["train", "--set", "train.steps="],
        "key `train.steps`: invalid type",
    ),
    (
        &["train", "--config", "missing.toml"],
        "missing.toml: cannot read: No such file or directory",
    ),
    (
        &["train", "--config", "badtype.toml"],
        "badtype.toml:2:9: key `train.steps`: invalid type: string \"ten\"",
    ),
    (
        &["train", "--config", "badsyntax.toml"],
        "badsyntax.toml:1:7: unclosed table",
    ),
    (
        &["train", "--config", "badsection.toml"],
        "badsection.toml:1:2: unknown field `trian`",
    ),
    (&["train", "--config", "notutf8.toml"], "notutf8.toml"),
    // the model's family and its keys
    (
        &["train", "--set", "model.arch=llama2"],
        "key `model.arch`: unknown variant `llama2`, expected one of `gpt2`, `llama`, `qwen3`, `mistral`",
    ),
    (
        &["train", "--set", "model.n_kv_head=2"],
        "key `model.n_kv_head`: is a setting of the Llama-like families",
    ),
    (
        &[
            "train",
            "--set",
            "model.arch=llama",
            "--set",
            "model.n_kv_head=3",
        ],
        "key `model.n_kv_head`: = 3 must be at least 1 and divide n_head = 4",
    ),
    (
        &[
            "train",
            "--set",
            "model.arch=llama",
            "--set",
            "model.n_kv_head=2",
            "--set",
            "model.n_head=6",
            "--set",
            "model.n_embd=96",
            "--set",
            "parallel.tp=3",
        ],
        "key `parallel.tp`: must divide the model's key/value heads (2) or be a multiple of them",
    ),
    (
        &["train", "--init-from", "/nonexistent/hf-folder"],
        "key `model.init_from`: /nonexistent/hf-folder: not a directory",
    ),
    (
        &["train", "--set", "model.first_dense=1"],
        "key `model.first_dense`: = 1 must be less than n_layer = 2 and needs moe.experts > 0",
    ),
    (
        &[
            "train",
            "--set",
            "model.arch=qwen3-moe",
            "--set",
            "model.moe.experts=4",
            "--set",
            "model.moe.shared_experts=1",
        ],
        "key `model.moe.shared_experts`: Qwen3-MoE has no shared experts",
    ),
    (
        &[
            "train",
            "--set",
            "model.arch=llama",
            "--set",
            "model.rope_theta=-1",
        ],
        "key `model.rope_theta`",
    ),
    (
        &[
            "plan",
            "--set",
            "model.arch=llama",
            "--set",
            "model.n_kv_head=2",
            "--set",
            "model.n_head=6",
            "--set",
            "model.n_embd=96",
            "--set",
            "parallel.tp=3",
        ],
        "key `parallel.tp`: must divide the model's key/value heads (2) or be a multiple of them",
    ),
    // values out of range: the key and the range
    (
        &["train", "--set", "optim.lr=0"],
        "key `optim.lr`: must be a finite value > 0 (got 0)",
    ),
    (
        &["train", "--set", "optim.lr=nan"],
        "key `optim.lr`: must be a finite value > 0 (got NaN)",
    ),
    (
        &["train", "--set", "optim.beta1=1"],
        "key `optim.beta1`: must be in [0, 1) (got 1)",
    ),
    (
        &["train", "--set", "model.n_head=3"],
        "key `model.n_head`: = 3 must be at least 1 and divide n_embd = 128",
    ),
    (
        &["train", "--set", "model.n_embd=0"],
        "key `model.n_embd`: must be at least 1",
    ),
    (
        &["train", "--set", "model.n_layer=0"],
        "key `model.n_layer`: must be at least 1",
    ),
    (
        &["train", "--set", "train.batch_size=0"],
        "key `train.batch_size`: must be at least 1",
    ),
    (
        &[
            "train",
            "--set",
            "train.batch_size=7",
            "--set",
            "parallel.dp=2",
        ],
        "key `train.batch_size`: = 7 sequences cannot be shared by dp = 2",
    ),
    (
        &["train", "--set", "parallel.tp=3"],
        "key `parallel.tp`: must divide the model's heads (4;",
    ),
    (
        &["train", "--set", "parallel.sequence_parallel=true"],
        "key `parallel.sequence_parallel`: splits the tensor-parallel group's tokens",
    ),
    (
        &["train", "--set", "parallel.fsdp=\"sometimes\""],
        "unknown variant `sometimes`, expected one of `none`",
    ),
    (
        &["train", "--set", "parallel.backend=\"carrier-pigeon\""],
        "unknown variant `carrier-pigeon`",
    ),
    (
        &["train", "--set", "parallel.timeout_s=0"],
        "key `parallel.timeout_s`: must be a number of seconds > 0",
    ),
    (
        &["train", "--set", "data.val_fraction=0.9"],
        "key `data.val_fraction`: must be in (0, 0.5]",
    ),
    (
        &["train", "--set", "train.nonfinite_limit=0"],
        "key `train.nonfinite_limit`: must be at least 1",
    ),
    (
        &["train", "--set", "train.skip_batches=[0]"],
        "key `train.skip_batches`: steps count from 1",
    ),
    (
        &["train", "--set", "train.straggler_factor=0.5"],
        "key `train.straggler_factor`: must be > 1, or 0 for off",
    ),
    (
        &["train", "--set", "train.straggler_window=0"],
        "key `train.straggler_window`: must be at least 1",
    ),
    (
        &["train", "--set", "train.recompute=\"every:0\""],
        "key `train.recompute`: unknown recomputation `every:0`: expected `none`, `full`, `selective` or `every:K`",
    ),
    (
        &["plan", "--recompute", "some"],
        "unknown recomputation `some`",
    ),
    (
        &["plan", "--set", "train.steps=1", "--loss-chunk", "1000"],
        "--loss-chunk 1000: invalid config: `loss_chunk` must be a multiple of 1024 tokens",
    ),
    // the device: a GPU that is not here (never a panic), and what the
    // GPU loop does not do
    (&["train", "--device", "tpu"], "unknown device `tpu`"),
    (
        &["train", "--device", "cuda:4096"],
        "key `train.device`: `cuda:4096`: ",
    ),
    (
        &["train", "--device", "cuda", "--set", "parallel.dp=2"],
        "key `parallel.dp`: = 2: train.device = \"cuda:0\" trains on one GPU as one rank",
    ),
    (
        &["train", "--device", "cuda", "--set", "model.moe.experts=4"],
        "key `model.moe.experts`: = 4: the GPU model",
    ),
    (
        &["train", "--set", "run.name=\"../x\""],
        "key `run.name`: is the run folder's name inside run.dir, not a path",
    ),
    // sizes no machine has: refused before anything is allocated
    (
        &[
            "train",
            "--set",
            "model.n_embd=1000000000",
            "--set",
            "model.n_head=1",
        ],
        "the largest part is the blocks' parameters",
    ),
    (
        &["train", "--set", "train.batch_size=1000000000"],
        "125000000 micro-batches of 8 per step",
    ),
    (
        &[
            "train",
            "--set",
            "train.batch_size=1000000000",
            "--set",
            "train.micro_batch_size=1000000000",
        ],
        "this machine has",
    ),
    (
        &["train", "--set", "model.block_size=100000000"],
        "this machine has",
    ),
    // numbers sizing allocations or loops: refused before either
    (
        &["sample", "--run", "r", "--tokens", "18446744073709551615"],
        "18446744073709551615 is not in 0..=1048576",
    ),
    (
        &["sample", "--run", "bigrun"],
        "the largest part is the blocks' parameters: model.n_layer (2) × 12 × model.n_embd² (65536²)",
    ),
    (
        &["moe", "audit", "--experts", "100000000"],
        "`experts` = 100000000: a trial's logits (batch 4 × seq_len 32 × experts) exceed the audit's bound",
    ),
    (
        &["moe", "audit", "--trials", "18446744073709551615"],
        "`trials` = 18446744073709551615: at most 1048576",
    ),
    (
        &[
            "pipeline",
            "--schedule",
            "1f1b",
            "--stages",
            "100000",
            "--microbatches",
            "100000",
        ],
        "the bound on a schedule's size",
    ),
    (
        &[
            "plan",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--seq",
            "64",
            "--vocab",
            "100",
            "--gpus",
            "0",
            "--cluster",
            "this-machine",
            "--global-batch",
            "8",
        ],
        "--gpus 0: plan for at least 1 GPU",
    ),
    (
        &[
            "plan",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--seq",
            "64",
            "--vocab",
            "100",
            "--global-batch",
            "9223372036854775808",
        ],
        "make more than 1048576 micro-batches per step",
    ),
    (
        &[
            "plan",
            "--layers",
            "10000",
            "--hidden",
            "100000",
            "--heads",
            "100",
            "--seq",
            "2048",
            "--vocab",
            "50000",
            "--global-batch",
            "1024",
            "--gpus",
            "65536",
        ],
        "passes in all, more than the search's bound of 33554432",
    ),
    (
        &["train", "--set", "data.synthetic.regular=4000000000"],
        "key `data.synthetic.regular`: regular + copy_tokens = 4000000006 tokens, more than the synthetic corpus's bound of 1048576",
    ),
    (
        &["train", "--set", "train.eval_sequences=1000000000000"],
        "key `train.eval_sequences`: must be in 1..=1048576",
    ),
    (
        &[
            "data",
            "prepare",
            "empty.txt",
            "--out",
            "p",
            "--threads",
            "100000",
        ],
        "--threads: 100000 tokenizer threads, more than 4 per core",
    ),
    (
        &["train", "--config", "blend_inf.toml"],
        "key `data.blend[0].weight`: = 1e308 is a share of 0e0 of the weights' sum inf",
    ),
    (
        &["train", "--config", "blend_tiny.toml"],
        "key `data.blend[0].weight`: = 1e-300 is a share of 1e-300 of the weights' sum 1e0; each share must be at least 1e-6",
    ),
    // data and run folders
    (
        &["train", "--data", "missing.txt"],
        "cannot read data missing.txt: No such file or directory",
    ),
    (&["train", "--data", "empty.txt"], "data empty.txt is empty"),
    (
        &["train", "--resume", "nowhere"],
        "cannot resume: run folder nowhere does not exist",
    ),
    (&["sample", "--run", "nowhere"], "nowhere: not a run folder"),
    (&["ckpt", "verify", "nowhere"], "opening checkpoint nowhere"),
    (&["viz", "nowhere"], "run folder nowhere not found"),
    // faults, supervision, drills
    (&["train", "--inject", "kill:step=0"], "is not a step ≥ 1"),
    (
        &["train", "--inject", "explode:step=3"],
        "unknown fault \"explode\"",
    ),
    (
        &["train", "--supervise", "--heartbeat-timeout", "0"],
        "--heartbeat-timeout 0: a number of seconds > 0",
    ),
    (
        &[
            "train",
            "--supervise",
            "--hostfile",
            "nothere",
            "--launch",
            "mpirun -np {n} --hostfile {hostfile}",
        ],
        "--hostfile nothere: no such file",
    ),
    (
        &[
            "train",
            "--supervise",
            "--launch",
            "mpirun -np {n} --hostfile {hostfile}",
        ],
        "--launch uses {hostfile} but no --hostfile is given",
    ),
    (
        &[
            "train",
            "--supervise",
            "--hostfile",
            "hosts.txt",
            "--launch",
            "mpirun -np {n}",
        ],
        "--launch has no {hostfile}",
    ),
    (
        &["train", "--supervise", "--shrink"],
        "--shrink: no smaller parallel.dp than 1 fits",
    ),
    (
        &["chaos", "--heartbeat-timeout", "0"],
        "--heartbeat-timeout 0: a number of seconds > 0",
    ),
    (
        &["chaos", "--trials", "1", "--set", "train.steps=x"],
        "key `train.steps`",
    ),
    (
        &["chaos", "--trials", "1", "--faults", "bogus"],
        "--faults: 'bogus' is no fault kind (kinds: kill, hang",
    ),
    (
        &["chaos", "--trials", "1", "--faults", "node-kill"],
        "--faults: 'node-kill' needs a cluster of nodes (--cluster NAME",
    ),
    (
        &["chaos", "--trials", "1", "--cluster", "nosuch"],
        "cluster 'nosuch': ",
    ),
    (
        &["chaos", "--trials", "1", "--set", "checkpoint.every=60"],
        "the drill's job: train.steps = 60 with checkpoint.every = 60: the drill needs two checkpoints",
    ),
    (
        &[
            "pipeline",
            "--schedule",
            "nope",
            "--stages",
            "2",
            "--microbatches",
            "4",
        ],
        "unknown schedule \"nope\": expected one of gpipe",
    ),
];

fn run(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(WEFT)
        .args(args)
        .current_dir(dir)
        .env("WEFT_CACHE", dir.join("cache"))
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_bad_input_gets_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("weft-bad-input-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in FILES {
        std::fs::create_dir_all(dir.join(name).parent().unwrap()).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let mut wrong = Vec::new();
    for (args, says) in CASES {
        let (code, err) = run(&dir, args);
        let clear = matches!(code, Some(c) if c != 0)
            && err.contains(says)
            && !err.contains("panicked")
            && !err.contains("RUST_BACKTRACE");
        if !clear {
            wrong.push(format!(
                "weft {}\n  exit {code:?}, expected {says:?}, got:\n{err}",
                args.join(" ")
            ));
        }
    }
    // nothing was started or written by a refused command
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !FILES.iter().any(|(f, _)| f.split('/').next() == Some(n)) && n != "cache")
        .collect();
    assert!(left.is_empty(), "refused commands wrote {left:?}");
    assert!(
        wrong.is_empty(),
        "{} of {} cases:\n{}",
        wrong.len(),
        CASES.len(),
        wrong.join("\n")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `n` gzip members of one MiB of `fill` each (readers of `.gz` read
/// concatenated members): a small file that inflates to `n` MiB.
fn gzip_bomb(prefix: &[u8], fill: u8, n: usize) -> Vec<u8> {
    use std::io::Write;
    let mut one = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    one.write_all(&vec![fill; 1 << 20]).unwrap();
    let one = one.finish().unwrap();
    let mut head = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    head.write_all(prefix).unwrap();
    let mut out = head.finish().unwrap();
    for _ in 0..n {
        out.extend_from_slice(&one);
    }
    out
}

/// Inputs that never end, block the open, or inflate without bound: each
/// refused by the one bounded reader (weft_trace::input), naming the file
/// and the bound, before memory grows or the process hangs.
#[cfg(unix)]
#[test]
fn unbounded_inputs_are_refused_naming_the_file_and_the_bound() {
    let dir = std::env::temp_dir().join(format!("weft-unbounded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).unwrap();
    let mkfifo = |name: &str| {
        let ok = Command::new("mkfifo").arg(dir.join(name)).status().unwrap();
        assert!(ok.success());
    };
    mkfifo("fifo.toml");
    mkfifo("fifo.txt");
    // 3 MB of gzip that inflates to 300 MiB: one document, or one line
    std::fs::write(dir.join("bomb.txt.gz"), gzip_bomb(b"", b'a', 300)).unwrap();
    std::fs::write(
        dir.join("line.jsonl.gz"),
        gzip_bomb(b"{\"text\": \"", b'a', 300),
    )
    .unwrap();
    // a run whose events.jsonl never ends
    let record =
        r#"{"step":1,"loss":2.0,"lr":0.001,"grad_norm":1.0,"tokens_per_s":1.0,"time_s":1.0}"#;
    std::fs::write(dir.join("run/metrics.jsonl"), format!("{record}\n")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("run/events.jsonl")).unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["train", "--config", "/dev/zero"],
            "/dev/zero: cannot read: not a regular file (a character device)",
        ),
        (
            &["train", "--config", "fifo.toml"],
            "fifo.toml: cannot read: not a regular file (a FIFO",
        ),
        (
            &["train", "--data", "/dev/zero"],
            "/dev/zero: not a regular file (a character device)",
        ),
        (
            &["train", "--data", "fifo.txt"],
            "fifo.txt: not a regular file (a FIFO",
        ),
        (
            &["data", "prepare", "fifo.txt", "--out", "p1"],
            "fifo.txt: not a regular file (a FIFO",
        ),
        (
            &["data", "prepare", "bomb.txt.gz", "--out", "p2"],
            "bomb.txt.gz: the text (one document per .txt; split it into several files) is larger than weft's bound of 256 MiB",
        ),
        (
            &["data", "prepare", "line.jsonl.gz", "--out", "p3"],
            "line.jsonl.gz:1: a line is larger than weft's bound of 256 MiB",
        ),
        (
            &["compare", "run", "run"],
            "events.jsonl: not a regular file (a character device)",
        ),
    ];
    let mut wrong = Vec::new();
    for (args, says) in cases {
        let (code, err) = run(&dir, args);
        let clear =
            matches!(code, Some(c) if c != 0) && err.contains(says) && !err.contains("panicked");
        if !clear {
            wrong.push(format!(
                "weft {}\n  exit {code:?}, expected {says:?}, got:\n{err}",
                args.join(" ")
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    std::fs::remove_dir_all(&dir).unwrap();
}
