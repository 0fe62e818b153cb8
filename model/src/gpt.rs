//! The GPT-2 model: parameters, planned activations, forward, backward,
//! and the AdamW step — the one block loop ([`crate::chunk`]) over the
//! model's resident buffers, with the per-block functions of
//! [`GptBlocks`].

use std::sync::Arc;

use weft_kernels::{AdamW, Mode, Precision};
use weft_parallel::{AdamWState, ParamLayout};

pub use crate::blocks::{BlockActs, BlockScratch, GptBlocks, HeadActs, WeightInputs};
use crate::chunk::{self, ChunkActs, ChunkInput, PieceRanges, Resident};
use crate::config::GptConfig;
use crate::error::Result;
use crate::ffn::{FeedForward, Mlp};
use crate::stage::StageSpec;
use crate::tp::TensorParallel;

/// One micro-batch: `B·T` input tokens and their `B·T` next-token targets.
#[derive(Clone, Copy, Debug)]
pub struct MicroBatch<'a> {
    /// Input token ids `(B,T)`.
    pub tokens: &'a [u32],
    /// Target token ids `(B,T)`.
    pub targets: &'a [u32],
}

/// A GPT-2-style transformer: configuration, the flat parameter and
/// gradient buffers (same [`ParamLayout`]), and the feed-forward block.
#[derive(Debug)]
pub struct Gpt {
    blocks: GptBlocks,
    ranges: PieceRanges,
    spec: StageSpec,
    /// All parameters in one allocation, in [`ParamLayout`] order.
    pub params: Vec<f32>,
    /// Gradients, same layout; [`Gpt::backward`] accumulates into them.
    pub grads: Vec<f32>,
}

/// Activation buffers for one batch shape, allocated once up front: one
/// [`BlockActs`] per layer, the head's [`HeadActs`], and one layer's worth
/// of backward working buffers, reused.
#[derive(Debug)]
pub struct Activations {
    chunk: ChunkActs,
    scratch: BlockScratch,
}

impl Activations {
    /// Batch size these buffers were planned for.
    pub fn batch(&self) -> usize {
        self.chunk.b
    }
    /// Sequence length these buffers were planned for.
    pub fn seq_len(&self) -> usize {
        self.chunk.t
    }
    /// Total bytes of all activation and backward buffers.
    pub fn bytes(&self) -> usize {
        self.chunk.bytes() + self.scratch.bytes()
    }
    /// [`bytes`](Self::bytes) divided by the B·T tokens of the batch.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes() / (self.chunk.b * self.chunk.t).max(1)
    }
    /// Logits `(B,T,V)` of the last forward (after a backward they hold the
    /// logits' gradient instead; under a loss chunk, one chunk's: see
    /// [`HeadActs::logits`]).
    pub fn logits(&self) -> &[f32] {
        self.chunk.head.as_ref().map_or(&[], HeadActs::logits)
    }
    /// Per-token losses `(B,T)` of the last forward with targets.
    pub fn losses(&self) -> &[f32] {
        self.chunk.head.as_ref().map_or(&[], HeadActs::losses)
    }
}

impl Gpt {
    /// A dense GPT-2 with all parameters zero (load or initialise them next).
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) if the configuration is inconsistent.
    pub fn new(config: GptConfig) -> Result<Self> {
        Self::with_ffn(config, Box::new(Mlp))
    }

    /// A GPT-2 whose blocks use a custom feed-forward block.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) if the configuration is inconsistent.
    pub fn with_ffn(config: GptConfig, ffn: Box<dyn FeedForward>) -> Result<Self> {
        Ok(Self::from_blocks(GptBlocks::new(config, Arc::from(ffn))?))
    }

    /// A model running `blocks` (one rank's, or a tensor-parallel rank's
    /// shard), with all parameters zero.
    pub fn from_blocks(blocks: GptBlocks) -> Self {
        let n = blocks.layout().len();
        Gpt {
            ranges: blocks.whole_ranges(),
            spec: StageSpec::whole(blocks.config().n_layer),
            blocks,
            params: vec![0.0; n],
            grads: vec![0.0; n],
        }
    }

    /// This rank's shard of `whole` split over the tensor-parallel group
    /// `tp` (the same feed-forward block; every rank of the group calls it
    /// with the same model): its blocks run the sharding styles of the
    /// [`tp`](crate::tp) module, its parameters are cut from `whole`'s by
    /// their placements. Its [`forward`](Self::forward) and
    /// [`backward`](Self::backward) are collective over the group; under
    /// sequence parallelism the layernorms' gradients are partial sums
    /// over it ([`weft_parallel::Placement::Partial`]), which a
    /// [`GradReducer`](weft_parallel::GradReducer) finishes.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) if the model does not split
    /// over `tp`; [`Error::Parallel`](crate::Error::Parallel) if `whole`'s
    /// parameters do not fit its layout.
    pub fn shard_of(whole: &Gpt, tp: TensorParallel) -> Result<Self> {
        let blocks = GptBlocks::with_tp(whole.config().clone(), whole.blocks.ffn().clone(), tp)?;
        let mut m = Self::from_blocks(blocks);
        m.load_part(whole)?;
        Ok(m)
    }

    /// Copies this model's part of `whole` (the unsharded model) into its
    /// parameters, as its layout's placements cut it: its tensor-parallel
    /// shard, its experts (`weft_parallel::extract`).
    ///
    /// # Errors
    /// [`Error::Parallel`](crate::Error::Parallel) if a tensor is missing
    /// from `whole` or has another whole shape there.
    pub fn load_part(&mut self, whole: &Gpt) -> Result<()> {
        let Gpt { blocks, params, .. } = self;
        weft_parallel::extract(blocks.layout(), whole.layout(), &whole.params, params)?;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        self.blocks.config()
    }

    /// The per-block functions this model runs (and their parameter
    /// ranges).
    pub fn blocks(&self) -> &GptBlocks {
        &self.blocks
    }

    /// The parameter layout (names, shapes, offsets, placements).
    pub fn layout(&self) -> &ParamLayout {
        self.blocks.layout()
    }

    /// How the forward's linear layers split their work (default:
    /// batch-invariant, so logits and per-token losses of a sequence are
    /// bitwise the same in any batch). The backward always runs whole-batch
    /// GEMMs: parameter gradients are sums over the batch anyway.
    pub fn set_mode(&mut self, mode: Mode) {
        self.blocks.set_mode(mode);
    }

    /// Sets the arithmetic of the linear layers' products (default f32;
    /// see [`GptBlocks::set_precision`]).
    pub fn set_precision(&mut self, precision: Precision) {
        self.blocks.set_precision(precision);
    }

    /// Activation recomputation (default none; see
    /// [`GptBlocks::set_recompute`]): plan [`activations`](Self::activations)
    /// after setting it.
    pub fn set_recompute(&mut self, recompute: crate::Recompute) {
        self.blocks.set_recompute(recompute);
    }

    /// The loss in chunks of `tokens` (default 0: the whole micro-batch;
    /// see [`GptBlocks::set_loss_chunk`]): plan
    /// [`activations`](Self::activations) after setting it.
    ///
    /// # Errors
    /// As [`GptBlocks::set_loss_chunk`].
    pub fn set_loss_chunk(&mut self, tokens: usize) -> Result<()> {
        self.blocks.set_loss_chunk(tokens)
    }

    /// Document masking (default off; see
    /// [`GptBlocks::set_doc_boundary`]).
    pub fn set_doc_boundary(&mut self, boundary: Option<u32>) {
        self.blocks.set_doc_boundary(boundary);
    }

    /// A named parameter tensor.
    pub fn param(&self, name: &str) -> Option<&[f32]> {
        self.layout().get(name).map(|s| &self.params[s.range()])
    }

    /// A named gradient tensor.
    pub fn grad(&self, name: &str) -> Option<&[f32]> {
        self.layout().get(name).map(|s| &self.grads[s.range()])
    }

    /// GPT-2's initialisation: N(0, 0.02) weights (the residual projections
    /// scaled by 1/sqrt(2L)), zero biases, unit layernorm gains, each
    /// element a function of the seed, its tensor and its index in the
    /// whole tensor ([`crate::init_gpt2`]: a sharded model's part is
    /// initialised the same). Not PyTorch's stream.
    pub fn init_gpt2(&mut self, seed: u64) {
        let n_layer = self.config().n_layer;
        let Gpt { blocks, params, .. } = self;
        // the layout fits the buffer and its own coordinates by construction
        let r = crate::init::init_gpt2(blocks.layout(), params, seed, n_layer);
        debug_assert!(r.is_ok(), "{r:?}");
    }

    /// Plans (allocates) activation buffers for batches of `b` sequences of
    /// `t` tokens.
    ///
    /// # Errors
    /// [`Error::Batch`](crate::Error::Batch) if `t` exceeds the model's `block_size` or `b*t` is 0.
    pub fn activations(&self, b: usize, t: usize) -> Result<Activations> {
        Ok(Activations {
            chunk: ChunkActs::new(&self.blocks, &self.spec, b, t, false)?,
            scratch: self.blocks.scratch(b, t)?,
        })
    }

    /// Forward pass over `tokens (B,T)`. With `targets (B,T)` it also
    /// computes the per-token cross-entropy and returns the mean loss
    /// (accumulated in f64); without, it returns `None` and only the logits
    /// are meaningful.
    ///
    /// # Errors
    /// [`Error::Batch`](crate::Error::Batch) if `tokens`/`targets` do not hold B·T ids for the
    /// planned `acts`; a kernel error ([`weft_kernels::Error::TokenOutOfRange`])
    /// for an id outside the vocabulary.
    pub fn forward(
        &self,
        acts: &mut Activations,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        let mut store = Resident {
            ranges: &self.ranges,
            params: &self.params,
            grads: None,
            copy: None,
        };
        chunk::forward(
            &self.blocks,
            &self.spec,
            &mut store,
            &mut acts.chunk,
            &mut acts.scratch,
            ChunkInput::Tokens(tokens),
            tokens,
            targets,
        )
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        weft_kernels::zero(&mut self.grads);
    }

    /// Backward pass of the mean loss of the last [`forward`](Self::forward)
    /// (which must have had targets), accumulating into
    /// [`grads`](Self::grads). Overwrites the logits with their gradient.
    ///
    /// # Errors
    /// [`Error::Batch`](crate::Error::Batch) if the last forward had no targets.
    pub fn backward(&mut self, acts: &mut Activations) -> Result<()> {
        let mut store = Resident {
            ranges: &self.ranges,
            params: &self.params,
            grads: Some(&mut self.grads),
            copy: None,
        };
        chunk::backward(
            &self.blocks,
            &self.spec,
            &mut store,
            &mut acts.chunk,
            &mut acts.scratch,
            None,
            None,
        )
    }

    /// One AdamW step over every parameter, decaying those whose
    /// [`ParamSpec::decay`](weft_parallel::ParamSpec::decay) is set.
    /// `state` holds the moments (create it with
    /// [`adamw_state`](Self::adamw_state)).
    ///
    /// # Errors
    /// [`Error::Parallel`](crate::Error::Parallel) if `state` was made for another model size
    /// (nothing is updated then).
    pub fn adamw_step(&mut self, state: &mut AdamWState, hp: &AdamW) -> Result<()> {
        let runs = self.blocks.layout().decay_runs();
        state.step(runs, &mut self.params, &self.grads, hp)?;
        Ok(())
    }

    /// Zero AdamW moments for this model's parameters.
    pub fn adamw_state(&self) -> AdamWState {
        AdamWState::zeros(self.params.len())
    }
}
