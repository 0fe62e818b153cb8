//! Save and load throughput against the disk's own sequential bandwidth,
//! measured in the same run, and the training-step stall of an async save
//! against a synchronous one.
//!
//! `cargo bench -p weft-checkpoint --bench throughput` (env:
//! `WEFT_BENCH_MB` data size, default 512; `WEFT_BENCH_DIR` where to write,
//! default the temp dir). Prints a table; nothing is asserted.
#![allow(clippy::print_stdout)]

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use weft_checkpoint::{
    AsyncSaver, Checkpoint, Dtype, Layout, OwnedShard, Region, SaveOptions, ShardData,
    TargetLayout, TrainerState, load_shards, save,
};

const MB: usize = 1 << 20;

fn raw_write(path: &Path, data: &[u8]) -> f64 {
    let t = Instant::now();
    let mut f = File::create(path).unwrap();
    for block in data.chunks(4 * MB) {
        f.write_all(block).unwrap();
    }
    f.sync_all().unwrap();
    t.elapsed().as_secs_f64()
}

fn raw_read(path: &Path, buf: &mut [u8]) -> f64 {
    let t = Instant::now();
    let mut f = File::open(path).unwrap();
    for block in buf.chunks_mut(4 * MB) {
        f.read_exact(block).unwrap();
    }
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

/// A fixed amount of arithmetic standing in for a training step.
fn step_work(buf: &mut [f32]) {
    for _ in 0..12 {
        for x in buf.iter_mut() {
            *x = x.mul_add(1.000_001, 1e-7);
        }
    }
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
    let mut readbuf = vec![0u8; flat.len()];
    let opts = SaveOptions::default();

    println!(
        "weft-checkpoint throughput: {:.0} MiB of f32 tensors, {world} ranks, fsync on, dir {}",
        bytes as f64 / MB as f64,
        dir.display()
    );
    println!(
        "(reads are from the page cache for both raw and checkpoint: this machine cannot drop caches)"
    );
    let reps = 3;
    let (mut w_raw, mut w_ck, mut r_raw, mut r_ck, mut r_re) =
        (f64::MAX, f64::MAX, f64::MAX, f64::MAX, f64::MAX);
    for rep in 0..reps {
        let raw = dir.join("raw.bin");
        w_raw = w_raw.min(raw_write(&raw, &flat));
        r_raw = r_raw.min(raw_read(&raw, &mut readbuf));
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
        w_ck = w_ck.min(t.elapsed().as_secs_f64());

        // Into preallocated memory, as a trainer restores its parameters.
        let t = Instant::now();
        let ck = Checkpoint::open(&c.path).unwrap();
        let mut pos = 0;
        for r in &ranks {
            for sh in r {
                let n = sh.data.len();
                ck.read_region_into(&sh.name, &sh.region, &mut readbuf[pos..pos + n])
                    .unwrap();
                pos += n;
            }
        }
        r_ck = r_ck.min(t.elapsed().as_secs_f64());
        assert_eq!(pos, bytes);

        // Another layout, into new buffers.
        let t = Instant::now();
        for r in 0..3u32 {
            load_shards(&ck, &TargetLayout::split_rows(3), r).unwrap();
        }
        r_re = r_re.min(t.elapsed().as_secs_f64());
        fs::remove_dir_all(&root).unwrap();
    }
    // Raw read into a new buffer: the fair baseline for loads into new memory.
    let raw = dir.join("raw.bin");
    raw_write(&raw, &flat);
    let t = Instant::now();
    let mut fresh = vec![0u8; flat.len()];
    raw_read(&raw, &mut fresh);
    let r_fresh = t.elapsed().as_secs_f64();
    drop(fresh);
    fs::remove_file(&raw).unwrap();
    let t = Instant::now();
    let crc = crc32c::crc32c(&flat);
    let crc_s = t.elapsed().as_secs_f64();
    println!();
    println!("crc32c alone: {:.2} GB/s (checksum {crc:08x})", gb / crc_s);
    println!("| operation                          | GB/s   | vs raw |");
    println!("|------------------------------------|--------|--------|");
    println!(
        "| raw sequential write + fsync       | {:6.2} |  1.00  |",
        gb / w_raw
    );
    println!(
        "| checkpoint save (4 files, fsync)   | {:6.2} |  {:.2}  |",
        gb / w_ck,
        w_raw / w_ck
    );
    println!(
        "| raw sequential read                | {:6.2} |  1.00  |",
        gb / r_raw
    );
    println!(
        "| checkpoint load into place (4)     | {:6.2} |  {:.2}  |",
        gb / r_ck,
        r_raw / r_ck
    );
    println!(
        "| load resharded 4 -> 3, new buffers | {:6.2} |  {:.2}  |",
        gb / r_re,
        r_raw / r_re
    );
    println!(
        "| raw read into a new buffer         | {:6.2} |  {:.2}  |",
        gb / r_fresh,
        r_raw / r_fresh
    );

    // Step stall: a save every `every` steps, sync vs async.
    let mut work = vec![1.0f32; 8 * MB];
    let steps: u32 = 12;
    let every: u32 = 4;
    let t = Instant::now();
    for _ in 0..steps {
        step_work(&mut work);
    }
    let step = t.elapsed().as_secs_f64() / f64::from(steps);

    let root = dir.join("sync");
    let mut sync_stall = 0.0;
    for s in 0..steps {
        step_work(&mut work);
        if s % every == every - 1 {
            let t = Instant::now();
            save(
                &root,
                u64::from(s),
                &layout,
                &borrowed,
                &TrainerState::default(),
                &opts,
            )
            .unwrap();
            sync_stall += t.elapsed().as_secs_f64();
        }
    }
    fs::remove_dir_all(&root).unwrap();

    let root = dir.join("async");
    let mut saver = AsyncSaver::new(&root, opts.clone()).unwrap();
    let mut async_stall = 0.0;
    let mut stalls = Vec::new();
    let t_all = Instant::now();
    for s in 0..steps {
        step_work(&mut work);
        if s % every == every - 1 {
            let t = Instant::now();
            if let Some(prev) =
                saver.save_from(u64::from(s), &layout, &borrowed, &TrainerState::default())
            {
                prev.unwrap();
            }
            stalls.push(t.elapsed().as_secs_f64());
            async_stall += t.elapsed().as_secs_f64();
        }
    }
    let t_wait = Instant::now();
    saver.wait().unwrap().unwrap();
    let tail = t_wait.elapsed().as_secs_f64();
    let async_total = t_all.elapsed().as_secs_f64();
    drop(saver);
    fs::remove_dir_all(&root).unwrap();
    let saves = f64::from(steps / every);
    println!();
    println!(
        "step stall per save ({} saves of {:.0} MiB, step = {:.1} ms of compute):",
        saves,
        bytes as f64 / MB as f64,
        step * 1e3
    );
    println!("| mode  | stall per save (ms) | stall / step |");
    println!("|-------|---------------------|--------------|");
    println!(
        "| sync  | {:19.1} | {:11.1}% |",
        sync_stall / saves * 1e3,
        sync_stall / saves / step * 100.0
    );
    println!(
        "| async | {:19.1} | {:11.1}% |",
        async_stall / saves * 1e3,
        async_stall / saves / step * 100.0
    );
    println!(
        "async run: {:.2} s total for {steps} steps, final wait {:.2} s; async/sync stall ratio {:.3}",
        async_total,
        tail,
        async_stall / sync_stall
    );
    let steady = stalls[1..].iter().copied().fold(f64::MAX, f64::min);
    println!(
        "async stall: first save {:.1} ms (allocates host buffers), later saves {:.1} ms \
         = {:.2} GB/s snapshot copy into reused buffers",
        stalls[0] * 1e3,
        steady * 1e3,
        gb / steady
    );
    // GPT-2 small with mixed-precision AdamW keeps ~16 B/parameter; on this
    // machine PyTorch trains it at ~200 tokens/s (batch 4 x 256 -> ~5.1 s/step).
    let state = 124e6 * 16.0 / 1e9;
    println!(
        "extrapolated: GPT-2 small ({state:.1} GB of state, ~5.1 s step): async stall ~{:.0} ms = {:.1}% of a step",
        state / (gb / steady) * 1e3,
        state / (gb / steady) / 5.12 * 100.0
    );
    fs::remove_dir_all(&dir).ok();
}
