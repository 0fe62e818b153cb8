//! The weft trainer: the thin composer behind the `weft` command.
//!
//! The libraries own the math, the communication and the formats; this
//! crate turns a job configuration into a run. What is here so far:
//!
//! * [`config`]: the job configuration — TOML files plus `--set key=value`
//!   overrides, with errors that name the key, the file, the line and the
//!   expected type.
//! * [`train`]: [`train::train`] runs a job and reports to an
//!   [`train::Observer`]; the loop itself is the `run` module — one loop for every
//!   model and layout, written against `weft_model::TrainModel`
//!   (`ParallelGpt` on the job's mesh, or one GPU's `CudaGpt`), in named
//!   parts: set-up, step, health and rewind, saving, tracing, the run
//!   folder.
//! * [`ranks`]: how the ranks of a run start — threads of this process,
//!   or one process per rank under `mpirun`/`srun` (feature `mpi`) — and
//!   how they agree on set-up failures so that one report says what went
//!   wrong.
//! * [`sample`]: `weft sample`, generation from a run's last checkpoint
//!   with the model's key/value-cache decoder.
//! * [`plan`]: `weft plan`, the planner's command line (`weft-plan`).
//!
//! Supervision (`weft train --supervise`), the faults to drill a run with
//! and `weft chaos` are `weft-supervise`'s; `weft compare` is
//! `weft-compare`'s and `weft viz` `weft-viz`'s; the data (`weft-data`),
//! the checkpoint format (`weft-checkpoint`) and the run files
//! (`weft-trace`) are their libraries'.
//!
//! # Layouts and what each guarantees
//!
//! `[parallel]` takes any combination of `dp`, `fsdp` (every strategy),
//! `tp` (with or without `sequence_parallel`), `pp` (every schedule) and
//! `ep` (dividing `dp`) whose degrees divide the model and the batch; the
//! world is `pp · dp · tp` ranks (threads of one process, or one MPI
//! process each under `mpirun`: see [`ranks`]), laid out `pp × edp × ep × tp`
//! with tensor parallelism innermost (a tp group is consecutive ranks and
//! one domain of the collectives' topology), then the expert and data
//! axes, the pipeline outermost; the start-up report prints the mesh and
//! every rank's coordinates. Against the single-rank run at the same
//! `train.micro_batch_size`, with reproducible sums (the default):
//!
//! | layout | guarantee | measured worst difference |
//! |---|---|---|
//! | dp, every fsdp strategy, pp (every schedule), and any combination of them | bitwise: losses, gradient norms, parameters | 0 (212 layouts) |
//! | with tp (and sp) | loss and norm within 1e-5 relative | 1.9e-8 dense, 8.7e-7 MoE |
//! | with ep | loss and norm within 1e-5 relative | 1.6e-7 |
//! | with tp and ep | loss and norm within 1e-5 relative | 1.3e-6 |
//!
//! Measured by `weft-model`'s `tests/compose.rs` over every layout of 1,
//! 2, 4 and 8 ranks of a 4-layer model (196 dense layouts, 391 with a
//! mixture of experts; three AdamW steps of a global batch of 8
//! micro-batches). Not bitwise there because the row-parallel layers and
//! the vocabulary-parallel cross-entropy sum partial products in another
//! order, and the experts' GEMMs under ep run over other ranks' rows.
//! Checkpoints are whole, so a run resumes on any layout: bit for bit
//! between bitwise-equivalent layouts (8 ranks to 1 and 1 to 8 tested).
//!
//! Over MPI processes every layout gives bitwise the thread ranks' run
//! (the same mesh, the same algorithms and reduction order; `tests/mpi.rs`
//! compares dp, fsdp, tp with sp, pp, ep and three composed layouts over 2
//! and 4 processes), except that plain sums (`parallel.reproducible =
//! false`) below 2 MiB (64 KiB when a group spans nodes) are the MPI
//! library's `MPI_Iallreduce`, equal to rounding.
//!
//! # Example
//! ```
//! use weft_data::SyntheticLanguage;
//! use weft_trainer::config::Config;
//!
//! let config = Config::load(None, &["optim.lr=1e-3".to_string()])?;
//! assert_eq!(config.optim.lr, 1e-3);
//! let lang = SyntheticLanguage::new(config.data.synthetic.clone())?;
//! assert_eq!(lang.vocab_size(), 256);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Crate features
//! * `mpi`: one rank per process under an MPI launcher (`mpirun -np N weft
//!   train`), over `weft-collectives`' MPI backend; needs an MPI library
//!   at build time.
//! * `nccl` (implies `mpi`): `parallel.backend = "nccl"`, NCCL across GPUs
//!   with its communicator id broadcast over MPI (the model still
//!   computes on the CPU).
//! * `cuda`: `train.device = "cuda"` / `"cuda:N"` (or `weft train --device
//!   cuda`) trains on one GPU as one rank: `weft_model::cuda::CudaGpt`
//!   (forward, backward, AdamW on the device) with the same data,
//!   schedule, AdamW settings, gradient accumulation over
//!   `train.micro_batch_size`, exact gradient norm, clipping and
//!   non-finite skip as the CPU loop, evaluation by forward passes, and
//!   checkpoints in the CPU's format (parameters and moments downloaded),
//!   so a run resumes on either device; utilisation against the GPU's
//!   datasheet dense peak (A100, H100 SXM, H200; unknown otherwise).
//!   [`config::Config::gpu_support`] refuses what it does not do: every
//!   layout but one rank, mixture-of-experts blocks, document masking,
//!   fp16 and rewinding. Builds without a CUDA toolkit; without a GPU the
//!   run stops with a configuration error naming `train.device` and what
//!   is missing. **Not yet run on a GPU**: `scripts/gpu-check.sh` compares
//!   it with the CPU loop on a GPU machine.

#![deny(missing_docs)]

pub mod config;
pub mod plan;
pub mod ranks;
mod run;
pub mod sample;
pub mod train;
