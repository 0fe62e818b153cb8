//! Save and load throughput against the disk's own sequential bandwidth,
//! measured in the same run on a same-sized file. (The training loop's
//! stall per save, background against synchronous, is measured on `weft
//! train` itself: `scripts/bench-save-stall.sh`.)
//!
//! `cargo bench -p weft-checkpoint --bench throughput` (env:
//! `WEFT_BENCH_MB` data size, default 512; `WEFT_BENCH_DIR` where to write,
//! default the temp dir). Prints tables; nothing is asserted.
//!
//! Throughput is measured twice, with the same page-cache state for the
//! raw baseline and the checkpoint:
//! * **cold**: every file is fsynced and dropped from the page cache
//!   (`posix_fadvise(DONTNEED)`) just before it is read, so reads come from
//!   the disk;
//! * **warm**: the files were just written and are in the page cache, so
//!   reads are memory copies (the ceiling for the checksum and copy work).
//!
//! The raw read baseline is the faster of one thread reading the file
//! sequentially in 4 MiB blocks and T threads (T = the loader's threads)
//! each reading a contiguous part; the checkpoint is compared with it.
#![allow(clippy::print_stdout)]

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Instant;

use weft_checkpoint::{
    Checkpoint, Dtype, Layout, OwnedShard, ReadRequest, Region, SaveOptions, ShardData,
    TargetLayout, TrainerState, load_shards, save,
};

const MB: usize = 1 << 20;

/// Flushes `path` (a file, or every file in a folder) and drops it from the
/// page cache, so that the next read comes from the disk.
fn evict(path: &Path) {
    if path.is_dir() {
        for e in fs::read_dir(path).unwrap() {
            evict(&e.unwrap().path());
        }
        return;
    }
    let f = File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: a plain syscall on an open descriptor; no memory is passed.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise on {}", path.display());
}

fn raw_write(path: &Path, data: &[u8]) -> f64 {
    let t = Instant::now();
    let mut f = File::create(path).unwrap();
    for block in data.chunks(4 * MB) {
        f.write_all(block).unwrap();
    }
    f.sync_all().unwrap();
    t.elapsed().as_secs_f64()
}

/// One thread, sequential 4 MiB reads.
fn raw_read(path: &Path, buf: &mut [u8]) -> f64 {
    let t = Instant::now();
    let mut f = File::open(path).unwrap();
    for block in buf.chunks_mut(4 * MB) {
        f.read_exact(block).unwrap();
    }
    t.elapsed().as_secs_f64()
}

/// `threads` threads, each reading a contiguous part in 4 MiB blocks with
/// its own handle.
fn raw_read_par(path: &Path, buf: &mut [u8], threads: usize) -> f64 {
    let t = Instant::now();
    let per = buf.len().div_ceil(threads);
    std::thread::scope(|sc| {
        for (i, part) in buf.chunks_mut(per).enumerate() {
            sc.spawn(move || {
                let f = File::open(path).unwrap();
                let mut off = (i * per) as u64;
                for block in part.chunks_mut(4 * MB) {
                    f.read_exact_at(block, off).unwrap();
                    off += block.len() as u64;
                }
            });
        }
    });
    t.elapsed().as_secs_f64()
}

/// A GPT-2-like set of f32 tensors of about `total` bytes.
fn tensors(total: usize) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    let c = 1024u64;
    let mut out = Vec::new();
    let mut have = 0usize;
    let mut i = 0;
    while have < total {
        let rows = (4 * c).min(((total - have) / (c as usize * 4)).max(1) as u64);
        let n = (rows * c) as usize * 4;
        let data: Vec<u8> = (0..n)
            .map(|k| (k as u32).wrapping_mul(2_654_435_761).to_le_bytes()[k % 4])
            .collect();
        out.push((format!("h.{i}.mlp.c_fc.weight"), vec![rows, c], data));
        out.push((
            format!("h.{i}.ln_1.weight"),
            vec![c],
            vec![1u8; c as usize * 4],
        ));
        have += n + c as usize * 4;
        i += 1;
    }
    out
}

fn fsdp(ts: &[(String, Vec<u64>, Vec<u8>)], world: usize) -> Vec<Vec<OwnedShard>> {
    (0..world)
        .map(|r| {
            ts.iter()
                .map(|(name, shape, data)| {
                    let region = Region::split(shape, 0, world, r);
                    let row = data.len() / shape[0] as usize;
                    let a = region.offsets[0] as usize * row;
                    let b = a + region.shape[0] as usize * row;
                    OwnedShard {
                        name: name.clone(),
                        dtype: Dtype::F32,
                        global_shape: shape.clone(),
                        region,
                        data: data[a..b].to_vec(),
                    }
                })
                .collect()
        })
        .collect()
}

/// Restores every rank's shards into preallocated (already touched)
/// buffers, one `read_many` per rank, as ranks restoring their parameters.
fn load_in_place(ck: &Checkpoint, ranks: &[Vec<OwnedShard>], bufs: &mut [Vec<Vec<u8>>]) -> f64 {
    let t = Instant::now();
    for (r, b) in ranks.iter().zip(bufs.iter_mut()) {
        let mut reqs: Vec<ReadRequest<'_>> = r
            .iter()
            .zip(b.iter_mut())
            .map(|(s, out)| ReadRequest {
                name: &s.name,
                region: s.region.clone(),
                out,
            })
            .collect();
        ck.read_many(&mut reqs).unwrap();
    }
    t.elapsed().as_secs_f64()
}

#[derive(Default)]
struct Best {
    w_raw: f64,
    w_ck: f64,
    raw1: [f64; 2],
    rawt: [f64; 2],
    load: [f64; 2],
    reshard: f64,
    fresh: f64,
}

fn min(a: &mut f64, b: f64) {
    if *a == 0.0 || b < *a {
        *a = b;
    }
}

fn throughput(dir: &Path, mb: usize) {
    let ts = tensors(mb * MB);
    let bytes: usize = ts.iter().map(|t| t.2.len()).sum();
    let gb = bytes as f64 / 1e9;
    let world = 4;
    let ranks = fsdp(&ts, world);
    let layout = Layout::flat("fsdp", world as u32);
    let borrowed: Vec<Vec<ShardData<'_>>> = ranks
        .iter()
        .map(|r| r.iter().map(OwnedShard::as_data).collect())
        .collect();
    let flat: Vec<u8> = ts.iter().flat_map(|t| t.2.iter().copied()).collect();
    drop(ts);
    let mut readbuf = vec![1u8; flat.len()];
    let mut bufs: Vec<Vec<Vec<u8>>> = ranks
        .iter()
        .map(|r| r.iter().map(|s| vec![1u8; s.data.len()]).collect())
        .collect();
    let opts = SaveOptions::default();
    let probe = tempfile_ck(dir, &layout, &borrowed, &opts);
    let threads = probe.threads();
    drop(probe);
    println!(
        "weft-checkpoint throughput: {:.0} MiB of f32 tensors in {world} rank files, fsync on, \
         loader threads {threads}, dir {}",
        bytes as f64 / MB as f64,
        dir.display()
    );
    let mut b = Best::default();
    for rep in 0..3 {
        let raw = dir.join("raw.bin");
        min(&mut b.w_raw, raw_write(&raw, &flat));
        // Warm (just written), then cold (evicted before each read).
        min(&mut b.raw1[0], raw_read(&raw, &mut readbuf));
        min(&mut b.rawt[0], raw_read_par(&raw, &mut readbuf, threads));
        evict(&raw);
        min(&mut b.raw1[1], raw_read(&raw, &mut readbuf));
        evict(&raw);
        min(&mut b.rawt[1], raw_read_par(&raw, &mut readbuf, threads));
        fs::remove_file(&raw).unwrap();

        let root = dir.join(format!("ck{rep}"));
        let t = Instant::now();
        let c = save(
            &root,
            1,
            &layout,
            &borrowed,
            &TrainerState::default(),
            &opts,
        )
        .unwrap();
        min(&mut b.w_ck, t.elapsed().as_secs_f64());
        let ck = Checkpoint::open(&c.path).unwrap();
        min(&mut b.load[0], load_in_place(&ck, &ranks, &mut bufs));
        evict(&c.path);
        min(&mut b.load[1], load_in_place(&ck, &ranks, &mut bufs));
        for (r, bb) in ranks.iter().zip(&bufs) {
            for (s, got) in r.iter().zip(bb) {
                assert!(s.data == *got, "{} read back wrong", s.name);
            }
        }
        // Another layout, into new buffers (warm).
        let t = Instant::now();
        for r in 0..3u32 {
            load_shards(&ck, &TargetLayout::split_rows(3), r).unwrap();
        }
        min(&mut b.reshard, t.elapsed().as_secs_f64());
        fs::remove_dir_all(&root).unwrap();
    }
    // Raw read into a new buffer: the fair baseline for loads into new memory.
    let raw = dir.join("raw.bin");
    raw_write(&raw, &flat);
    let t = Instant::now();
    let mut fresh = vec![0u8; flat.len()];
    raw_read_par(&raw, &mut fresh, threads);
    b.fresh = t.elapsed().as_secs_f64();
    drop(fresh);
    fs::remove_file(&raw).unwrap();

    let base = [b.raw1[0].min(b.rawt[0]), b.raw1[1].min(b.rawt[1])];
    println!(
        "best of 3 runs; \"vs raw\" is raw time / checkpoint time (same bytes, same cache state)"
    );
    println!("| operation                                     | GB/s   | vs raw |");
    println!("|-----------------------------------------------|--------|--------|");
    let row = |name: &str, s: f64, base: f64| {
        println!("| {name:45} | {:6.2} | {:6.2} |", gb / s, base / s);
    };
    row("raw sequential write + fsync", b.w_raw, b.w_raw);
    row("checkpoint save (4 files, fsync)", b.w_ck, b.w_raw);
    for (i, state) in ["warm", "cold"].iter().enumerate() {
        row(&format!("raw read, 1 thread ({state})"), b.raw1[i], base[i]);
        row(
            &format!("raw read, {threads} threads ({state})"),
            b.rawt[i],
            base[i],
        );
        row(
            &format!("checkpoint load into place ({state})"),
            b.load[i],
            base[i],
        );
    }
    row(
        "load resharded 4 -> 3, new buffers (warm)",
        b.reshard,
        base[0],
    );
    row("raw read into a new buffer (warm)", b.fresh, base[0]);
}

/// Saves once so that the loader's default thread count can be read.
fn tempfile_ck(
    dir: &Path,
    layout: &Layout,
    ranks: &[Vec<ShardData<'_>>],
    opts: &SaveOptions,
) -> Checkpoint {
    let small: Vec<Vec<ShardData<'_>>> = ranks
        .iter()
        .map(|r| {
            r.iter()
                .filter(|s| s.data.len() < 64 * 1024)
                .cloned()
                .collect()
        })
        .collect();
    let root = dir.join("probe");
    let c = save(&root, 0, layout, &small, &TrainerState::default(), opts).unwrap();
    let ck = Checkpoint::open(&c.path).unwrap();
    fs::remove_dir_all(&root).unwrap();
    ck
}

fn main() {
    let mb: usize = std::env::var("WEFT_BENCH_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512);
    let base = std::env::var_os("WEFT_BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("weft-ckpt-bench-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    println!(
        "CPUs {}, load average at start: {}",
        std::thread::available_parallelism().map_or(1, usize::from),
        fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    throughput(&dir, mb);
    println!(
        "load average at end: {}",
        fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    fs::remove_dir_all(&dir).ok();
}
