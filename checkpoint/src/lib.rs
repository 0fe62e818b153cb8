//! Distributed checkpoints that are atomic, verifiable and reshard on load.
//!
//! A months-long run survives only if its checkpoints can be trusted: every
//! rank saves its own shard, nothing half-written is ever taken for a
//! checkpoint, corruption is detected before it is trained on, and a
//! checkpoint saved by one layout (say FSDP over 4 ranks) loads on another
//! (2 ranks, or tensor parallelism 2 → 1).
//!
//! # Overview
//! * Saving: [`save`] does it all from one process; [`SharedSave`] lets
//!   rank *threads* each save their own shards into one staging folder and
//!   a coordinator commit (see "Sharded training" below); with ranks in
//!   separate processes the steps are [`prepare`] (coordinator),
//!   [`write_rank_file`] (each rank, returns a serializable [`RankReport`])
//!   and [`commit`] (coordinator, with every report). [`ShardData`] is one rank's piece of
//!   one tensor: a [`Region`] (row range, column range, or any box) of the
//!   global tensor. [`SaveOptions`] carries the checksum chunk size and a
//!   [`FaultHook`] for fault injection.
//! * [`collective`]: a job of many ranks over a `weft-collectives`
//!   communicator — [`collective::save`] (rank 0 prepares, every rank
//!   writes the runs of whole tensors it owns, rank 0 commits; one
//!   outcome on every rank), [`collective::Background`] (the same save on
//!   a thread and a communicator group of its own while the ranks train
//!   on, one save at a time), [`collective::Saver`] (a training loop's
//!   checkpoints, in the background or not, each reported with what it
//!   cost the loop: [`collective::Saved`]) and [`collective::pick_latest`]
//!   (rank 0 verifies and picks, every rank opens it);
//!   [`link_checkpoint`] gives a branching run another run's checkpoint.
//! * Loading: [`Checkpoint::open`] validates the manifest and every file's
//!   header, [`Checkpoint::read_region`] reads any box of any tensor, touching
//!   only the overlapping shards' byte ranges and verifying their checksums;
//!   [`load_latest`] picks the newest checkpoint that verifies and reports
//!   the ones it skipped. [`Checkpoint::verify`] checks every byte.
//!   [`Checkpoint::read_many`] restores many regions at once (a rank's
//!   parameters) on [`Checkpoint::threads`] threads: every checksum chunk
//!   is read straight into its destination in 256 KiB pieces, each
//!   checksummed while still in cache, the next chunk prefetched from disk
//!   meanwhile.
//! * [`reshard()`]: rewrites a checkpoint for another layout, described by a
//!   [`TargetLayout`] (e.g. [`TargetLayout::split_rows`]).
//! * [`Retention`]: keep the last K and every N-th; never delete the only
//!   checkpoint that verifies.
//! * [`export_hf_gpt2`]: a consolidated Hugging Face GPT-2 folder
//!   (`model.safetensors` + `config.json`).
//! * [`Checkpoint::info`] → [`Info`] (`Display` prints a table).
//! * Parsers safe on hostile input: [`Manifest::from_json`] and
//!   [`parse_header`] check every length, offset and name they read.
//!
//! # Example
//! ```
//! use weft_checkpoint::{
//!     Checkpoint, Dtype, Layout, Region, SaveOptions, ShardData, TrainerState, load_latest,
//!     save, VerifyLevel,
//! };
//!
//! let root = std::env::temp_dir().join(format!("weft-ckpt-doc-{}", std::process::id()));
//! // A 4x3 f32 matrix, saved FSDP-style by 2 ranks, each holding 2 rows.
//! let w: Vec<f32> = (0..12).map(|i| i as f32).collect();
//! let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
//! let shape = [4u64, 3];
//! let rank = |r: usize| {
//!     vec![ShardData {
//!         name: "w",
//!         dtype: Dtype::F32,
//!         global_shape: &shape,
//!         region: Region::split(&shape, 0, 2, r),
//!         data: &bytes[r * 24..(r + 1) * 24],
//!     }]
//! };
//! let state = TrainerState { optimizer_step: 10, ..Default::default() };
//! save(&root, 10, &Layout::flat("dp", 2), &[rank(0), rank(1)], &state, &SaveOptions::default())?;
//!
//! // Load on another layout: this reader wants columns 1..3 of every row.
//! let loaded = load_latest(&root, VerifyLevel::Full)?.expect("one checkpoint");
//! let ckpt: &Checkpoint = &loaded.checkpoint;
//! assert_eq!(ckpt.step(), 10);
//! let part = ckpt.read_region("w", &Region::new(vec![0, 1], vec![4, 2]))?;
//! let got: Vec<f32> = part.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
//! assert_eq!(got, [1.0, 2.0, 4.0, 5.0, 7.0, 8.0, 10.0, 11.0]);
//! # std::fs::remove_dir_all(&root).ok();
//! # Ok::<(), weft_checkpoint::Error>(())
//! ```
//!
//! # On-disk format (version 1)
//! A checkpoints root holds one folder per checkpoint and a pointer:
//! ```text
//! ROOT/
//!   latest                    "step-00001000\n": the last committed folder
//!   step-00001000/            a complete checkpoint
//!     manifest.json
//!     rank-00000.safetensors  one file per saving rank
//!     rank-00001.safetensors
//!   step-00002000.tmp/        a save in progress (or killed): never read
//! ```
//! Folder names are `step-` and the step in at least 8 decimal digits.
//! Anything else in the root (`*.tmp`, `*.replaced`, `*.deleting`) is not a
//! checkpoint.
//!
//! **Shard files** are standard safetensors files (8-byte little-endian
//! header length N, N bytes of JSON padded with spaces to a multiple of 8,
//! then data), readable by any safetensors reader. Each holds the rank's
//! pieces under the tensors' *global* names; a piece's safetensors `shape`
//! is the piece's shape, not the global one. A rank holding several
//! pieces of one tensor (the Q, K and V column blocks of a
//! tensor-parallel shard, a flat FSDP shard that starts and ends inside
//! rows) stores the second and later as `name#1`, `name#2`, … (by
//! offsets); `#` is not allowed in tensor names. `__metadata__` holds
//! `{"format": "pt", "weft.rank": "R"}`. Tensors are stored widest dtype
//! first, so every tensor is aligned to its element size.
//!
//! **`manifest.json`** (written last; its presence in a `step-*` folder is
//! what makes the folder a checkpoint):
//! ```json
//! {
//!   "format": "weft-checkpoint",
//!   "version": 1,
//!   "step": 1000,
//!   "layout": {"world_size": 2, "mesh": [{"name": "dp", "size": 2}]},
//!   "checksum": {"algorithm": "crc32c", "chunk_bytes": 4194304},
//!   "files": [{"name": "rank-00000.safetensors", "rank": 0, "bytes": 1048712}, ...],
//!   "tensors": {
//!     "wte.weight": {
//!       "dtype": "F32",
//!       "shape": [50304, 768],
//!       "shards": [
//!         {"file": "rank-00000.safetensors", "offsets": [0, 0], "shape": [25152, 768],
//!          "byte_offset": 128, "byte_len": 77266944, "crc32c": [3735928559, ...]},
//!         ...
//!       ]
//!     }
//!   },
//!   "state": {"optimizer_step": 1000, "config_hash": "…", "data_position": {…},
//!             "rng": {"rank0/data": "0123abcd…"}, "loss_scaler": {…}, "extra": {…}}
//! }
//! ```
//! * `dtype` uses safetensors' names (`F64 F32 F16 BF16 I64 I32 I16 I8 U64
//!   U32 U16 U8 BOOL`); all data is little-endian, row-major.
//! * A shard is the box `offsets .. offsets+shape` of the global tensor;
//!   its bytes are that box in row-major order, at `byte_offset ..
//!   byte_offset+byte_len` of `file` (absolute file offsets, equal to the
//!   safetensors header's `data_offsets` plus 8 plus N). The shards of a
//!   tensor cover it exactly once: row ranges (FSDP, row-parallel), column
//!   ranges (column-parallel), grids, or one whole-tensor shard for a
//!   replicated tensor (written once, by one rank). Empty shards are not
//!   stored; a tensor with zero elements has no shards.
//! * `crc32c` lists the CRC-32C (Castagnoli; `crc32c(b"123456789") ==
//!   0xE3069283`) of each consecutive `chunk_bytes` chunk of the shard's
//!   bytes, the last chunk possibly shorter. Chunking lets a resharding
//!   reader verify exactly the chunks it reads.
//! * `files[].bytes` is each file's exact size, so truncation is found
//!   without reading data.
//! * `state.rng` values are hex strings of raw RNG state bytes; the other
//!   `state` fields are free-form JSON written by the trainer.
//!
//! **Commit protocol.** Ranks write into `step-N.tmp/` and fsync their
//! files; the coordinator writes and fsyncs `manifest.json`, fsyncs the
//! folder, renames it to `step-N` and fsyncs the root; then writes
//! `latest.tmp`, fsyncs it and renames it over `latest`. A crash at any
//! point leaves either the previous checkpoint or the new one complete, and
//! readers ignore `.tmp` folders. A reader that finds `latest` one step
//! behind the newest complete folder (crash between the two renames) should
//! trust the folders, as [`load_latest`] does.
//!
//! **Reader limits.** Manifests over 256 MiB and safetensors headers over
//! 100 MiB are refused before allocation; shard file names must match
//! `rank-NNNNN.safetensors` (no separators, so no path leaves the folder);
//! tensors have at most 16 dimensions; all sizes are checked for overflow.
//!
//! # Tools
//! The `weft ckpt` subcommands (in the trainer binary) are thin wrappers:
//! * `verify DIR`: [`Checkpoint::open`] then [`Checkpoint::verify`]; the
//!   error names the file, tensor and byte range of any corruption.
//! * `info DIR`: print [`Checkpoint::info`].
//! * `reshard DIR --to LAYOUT OUT`: [`TargetLayout::parse`] (`N` or
//!   `N:dimD`) then [`reshard()`].
//! * `export DIR --hf OUT`: [`export_hf_gpt2`].
//!
//! # Sharded training (FSDP, tensor parallelism)
//! Every rank saves only what it holds, under the tensor's global name and
//! shape, with a [`Region`] saying where its piece sits:
//! * **FSDP / ZeRO flat parameters**: save each unit's flat buffer as a
//!   1-d tensor (e.g. `fsdp.h.3`, shape `[len]` without padding); rank `r`
//!   of `n` holding elements `r·s .. (r+1)·s` (`s = ceil(len/n)`) saves
//!   `Region::new(vec![a], vec![b - a])` with `a, b` clipped to `len`, so
//!   the padding is never stored (a rank whose range is all padding saves
//!   an empty shard, or nothing). A model tensor at elements
//!   `off .. off+numel` of the unit is
//!   `read_region("fsdp.h.3", &Region::new(vec![off], vec![numel]))`,
//!   whichever ranks hold it. AdamW moments: the same, under other names.
//! * **Tensor parallelism**: column-parallel weights are
//!   `Region::split(shape, 1, tp, t)`, row-parallel ones
//!   `Region::split(shape, 0, tp, t)`; with data parallelism on top only
//!   one replica (dp = 0) saves them. Replicated tensors are saved by one
//!   rank ([`ShardData::full`]); [`commit`] refuses a tensor tiled twice.
//! * **Layout**: [`Layout`] records the mesh (`[{"name":"dp","size":2},
//!   {"name":"tp","size":2}]`); it is informational: loading never needs
//!   it, since the manifest says where every piece is.
//! * **Saving from rank threads**: the coordinator calls
//!   [`SharedSave::begin`] (creates `step-N.tmp/`), shares it by reference
//!   with the rank threads, each calls [`SharedSave::write_rank`]
//!   concurrently (its own `rank-NNNNN.safetensors`, fsynced), then the
//!   coordinator calls [`SharedSave::commit`], which merges the reports
//!   into one manifest, checks that every tensor is tiled exactly once and
//!   commits atomically; a rank that did not report means nothing is
//!   committed. Ranks in other processes use [`write_rank_file`] on
//!   [`SharedSave::staging`] and send their [`RankReport`] (serde) for
//!   [`SharedSave::add_report`].
//! * **Loading on another layout** (n → m ranks, FSDP ↔ TP): each rank
//!   reads its new regions with [`Checkpoint::read_many`] or
//!   [`load_shards`] (with [`TargetLayout::custom`] for any rule); only
//!   the overlapping byte ranges of the old shards are read. [`reshard()`]
//!   rewrites a whole checkpoint for a new layout.
//!
//! # Testing, fuzzing, benchmarks
//! * `cargo test -p weft-checkpoint`: unit, property, fault-injection,
//!   SIGKILL, corruption and bounded fuzz tests. Two interop tests run an
//!   independent Python reader (`tests/python/weft_ckpt_check.py`: the
//!   `safetensors` package, and `transformers` for the GPT-2 export); they
//!   use `$WEFT_PYTHON`, else `~/.cache/weft-venv/bin/python`, else
//!   `python3`, and print `SKIPPED` when the modules are missing.
//! * `cd checkpoint/fuzz && cargo +nightly fuzz run manifest` (also
//!   `safetensors_header`, `open_checkpoint`).
//! * `cargo bench -p weft-checkpoint --bench throughput`: save and load
//!   GB/s next to the disk's raw sequential write and read measured in the
//!   same run.
//!
//! # Crate features
//! None. The collective saves (and saving in the background) use
//! `weft-collectives`.

#![deny(missing_docs)]

mod checksum;
pub mod collective;
mod dtype;
mod error;
mod export;
mod flat;
mod manifest;
mod read;
mod region;
mod reshard;
mod retention;
mod safetensors;
mod write;

pub use collective::CollectiveError;
pub use dtype::{Dtype, UnknownDtype};
pub use error::{Error, Result};
pub use export::{ExportReport, Gpt2Export, export_hf_gpt2};
pub use flat::{FlatBox, FlatRun, boxes_of_runs, flat_boxes};
pub use manifest::{
    ChecksumSpec, DEFAULT_CHUNK_BYTES, FORMAT_NAME, FORMAT_VERSION, FileEntry, HexBytes, Layout,
    MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest, MeshDim, ShardEntry, TensorEntry, TrainerState,
    file_name, valid_file_name,
};
pub use read::{
    Checkpoint, Info, Loaded, ReadRequest, TensorInfo, VerifyLevel, VerifyReport, list_checkpoints,
    load_latest, read_latest_pointer,
};
pub use region::Region;
pub use reshard::{TargetLayout, load_shards, reshard};
pub use retention::{Retention, RetentionReport};
pub use safetensors::{HeaderEntry, MAX_HEADER_BYTES, SafetensorsHeader, header_len, parse_header};
pub use write::{
    Committed, FaultHook, FaultPoint, LATEST_FILE, OwnedShard, RankReport, ReportedShard,
    SaveOptions, ShardData, SharedSave, build_manifest, commit, link_checkpoint, parse_step_dir,
    prepare, save, step_dir_name, write_rank_file,
};
