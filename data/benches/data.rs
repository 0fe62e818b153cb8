//! Data throughput, side by side in one run: `weft data prepare` (text
//! MB/s and tokens/s over the cores) and the training loader's sequences/s
//! from memory-mapped shards (each first read of a block checksummed).
//!
//! ```text
//! cargo bench -p weft-data --bench data
//! ```
//!
//! Prints a table. The loader must never be the bottleneck: compare its
//! sequences/s with what a training step consumes (`weft train` prints
//! tokens/s; divide by the block size).

#![allow(clippy::print_stdout)] // a bench binary prints its table

use std::ops::ControlFlow;
use std::time::Instant;

use weft_data::{Corpus, Loader, PrepareOptions, prepare};

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("text");
    std::fs::create_dir_all(&src).unwrap();
    // 32 MB of English-like text in 2,000 documents over 20 .jsonl files.
    let words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "training",
        "language",
        "model",
        "tokens",
        "gradient",
        "parallel",
        "pipeline",
        "expert",
        "memory",
        "bandwidth",
        "weft",
        "shard",
        "a",
        "is",
        "with",
    ];
    let mut x = 0x9e37_79b9u64;
    let mut bytes = 0usize;
    for f in 0..20 {
        let mut jsonl = String::new();
        for _ in 0..100 {
            let mut doc = String::new();
            while doc.len() < 16_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                doc.push_str(words[(x % words.len() as u64) as usize]);
                doc.push(if x.is_multiple_of(11) { '.' } else { ' ' });
            }
            bytes += doc.len();
            jsonl.push_str(&serde_json::json!({ "text": doc }).to_string());
            jsonl.push('\n');
        }
        std::fs::write(src.join(format!("part{f:02}.jsonl")), jsonl).unwrap();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("| step | threads | MB/s of text | tokens/s | sequences/s (T=1024) |");
    println!("|---|---|---|---|---|");
    let mut out = None;
    for threads in [1, cores] {
        let o = dir.path().join(format!("out{threads}"));
        let t = Instant::now();
        let r = prepare(
            std::slice::from_ref(&src),
            &o,
            &PrepareOptions {
                threads,
                ..Default::default()
            },
            &mut |_| ControlFlow::Continue(()),
        )
        .unwrap();
        let s = t.elapsed().as_secs_f64();
        println!(
            "| prepare | {threads} | {:.2} | {:.0} | |",
            bytes as f64 / s / 1e6,
            r.tokens as f64 / s
        );
        out = Some(o);
    }
    let corpus = Corpus::open(&out.unwrap(), 0.05).unwrap();
    let loader = Loader::new(vec![(corpus, 1.0)], 1024, 0).unwrap();
    let n = 20_000u64;
    let mut buf = Vec::with_capacity(1025);
    let t = Instant::now();
    for g in 0..n {
        buf.clear();
        loader.train_sequence(g, &mut buf).unwrap();
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "| loader | 1 | | {:.0} | {:.0} |",
        n as f64 * 1024.0 / s,
        n as f64 / s
    );
}
