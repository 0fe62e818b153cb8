//! A pipeline stage of a GPT: a contiguous range of layers, with the
//! embedding on the first stage and the head and loss on the last, owning
//! only its own parameters — the GPT's adapter to `weft-pipeline`
//! ([`weft_pipeline::Stage`]), whose executor knows nothing of GPTs.
//!
//! # Tied embeddings across stages
//!
//! With `tied_embeddings`, `wte` is both the first stage's embedding and
//! the last stage's `lm_head`: a [`weft_pipeline::Shared`] parameter. The
//! embedding stage owns `wte` (it is in its [`params`](GptStage::params)
//! under `transformer.wte.weight`, so the stages' parameter sets partition
//! the model's exactly once); the head stage keeps a read-only *copy*
//! outside its parameters. Per micro-batch the head stage computes its part
//! of `wte`'s gradient into a zeroed buffer during its (input) backward
//! ([`Stage::shared_grad`](weft_pipeline::Stage::shared_grad)); the
//! executor sends it to the embedding stage, which stores it
//! ([`Stage::add_shared_grad`](weft_pipeline::Stage::add_shared_grad))
//! before that micro-batch's embedding backward (its `W`, or its whole
//! backward) adds it to `wte`'s gradient and then accumulates the
//! embedding's own part on top — the order a single [`Gpt`](crate::Gpt)
//! uses, so the micro-batch's `wte` gradient has the bits of the single
//! model's. After the optimizer step the executor's `sync_shared` copies
//! the embedding stage's `wte` back to the head stage. The cost is one
//! `V·C` message per micro-batch from the last stage to the first.

use std::ops::Range;

use crate::config::GptConfig;
use crate::error::{Error, Result};
use crate::gpt::{BlockActs, BlockScratch, GptBlocks, HeadActs, MicroBatch, WeightInputs};
use weft_parallel::{ParamLayout, ParamSpec};

/// Which part of the model a stage holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// The transformer blocks, a contiguous range of layer indices (may be
    /// empty for an embedding-only or head-only stage).
    pub layers: Range<usize>,
    /// Whether the stage starts with the embedding (`wte`, `wpe`); then
    /// `layers` must start at 0.
    pub embed: bool,
    /// Whether the stage ends with the head (`ln_f`, `lm_head`, loss); then
    /// `layers` must end at `n_layer`.
    pub head: bool,
    /// Its position among the model's stages (its virtual stage): the
    /// embedding stage is 0.
    pub index: usize,
    /// The number of stages the model is cut into.
    pub stages: usize,
}

impl StageSpec {
    /// The `stage`-th of the contiguous stages holding `layers_per_stage[i]`
    /// layers each (e.g. a `weft_pipeline::Partition`'s layers per chunk, in model
    /// order): the embedding on the first, the head on the last.
    ///
    /// # Errors
    /// [`Error::Config`] if `stage` is out of range.
    pub fn nth(layers_per_stage: &[usize], stage: usize) -> Result<Self> {
        if stage >= layers_per_stage.len() {
            return Err(Error::Config {
                field: "pipeline stage",
                reason: format!(
                    "stage {stage} out of range for {} stages",
                    layers_per_stage.len()
                ),
            });
        }
        let start: usize = layers_per_stage[..stage].iter().sum();
        Ok(StageSpec {
            layers: start..start + layers_per_stage[stage],
            embed: stage == 0,
            head: stage + 1 == layers_per_stage.len(),
            index: stage,
            stages: layers_per_stage.len(),
        })
    }
}

/// What a stage's forward takes in.
#[derive(Clone, Copy, Debug)]
enum StageInput<'a> {
    /// Token ids `(B,T)` (the embedding stage).
    Tokens(&'a [u32]),
    /// The previous stage's output `(B,T,C)`.
    Hidden(&'a [f32]),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Forwarded,
    InputDone,
}

#[derive(Debug)]
struct Slot {
    mb: usize,
    state: SlotState,
    tokens: Vec<u32>,
    input: Vec<f32>, // (B,T,C): received activations or the embedding's output
    layers: Vec<BlockActs>,
    head: Option<HeadActs>,
    saved: Vec<WeightInputs>,
    dres: Vec<f32>,      // (B,T,C): d(input) after B
    tied_dwte: Vec<f32>, // (V,C) when the tied-embedding exchange applies
    tied_ready: bool,
    loss: Option<f64>,
}

/// One pipeline stage of a GPT (see the module docs): its parameters and
/// gradients (HF-named, [`specs`](Self::specs)), and activation storage
/// for `slots` micro-batches in flight, each of `B` sequences of `T`
/// tokens.
///
/// Micro-batches are named by their index; [`forward`](weft_pipeline::Stage::forward)
/// takes a free slot for it, and the last backward step
/// ([`backward`](weft_pipeline::Stage::backward), or [`backward_weight`](weft_pipeline::Stage::backward_weight)
/// after [`backward_input`](weft_pipeline::Stage::backward_input)) frees it. Gradients
/// accumulate (`+=`) into [`grads`](Self::grads) with the same kernel calls
/// as [`Gpt::backward`](crate::Gpt::backward).
///
/// The head's weight gradients (`ln_f`, `lm_head`) are computed in
/// `backward_input`: splitting them would cost a second `V`-wide GEMM.
#[derive(Debug)]
pub struct GptStage {
    blocks: GptBlocks,
    spec: StageSpec,
    layout: ParamLayout,
    /// (local range, range in the full layout) of each piece.
    segments: Vec<(Range<usize>, Range<usize>)>,
    embed: Option<Range<usize>>,
    layer_ranges: Vec<Range<usize>>,
    lnf: Option<Range<usize>>,
    lm_head: Option<Range<usize>>, // local; None for the tied copy
    tied_copy: Option<Vec<f32>>,
    /// Head side of the tied exchange: the latest micro-batch's head `wte`
    /// gradient, and which micro-batch it belongs to.
    tied_out: Vec<f32>,
    tied_out_mb: Option<usize>,
    /// This stage's parameters, in model order.
    pub params: Vec<f32>,
    /// Their gradients (same order).
    pub grads: Vec<f32>,
    slots: Vec<Slot>,
    scratch: BlockScratch,
    b: usize,
    t: usize,
}

impl GptStage {
    /// A stage of a model whose full parameters follow `layout` (made from
    /// the same configuration and feed-forward block as `blocks`), planned
    /// for `slots` micro-batches of `b`×`t` tokens in flight; `split`
    /// plans what [`backward_input`](weft_pipeline::Stage::backward_input) saves for
    /// [`backward_weight`](weft_pipeline::Stage::backward_weight) (per layer per slot,
    /// 7·B·T·C floats plus the feed-forward block's own: 11·B·T·C with the
    /// dense MLP). Parameters start at zero: copy them in with
    /// [`load_from_full`](Self::load_from_full).
    ///
    /// # Errors
    /// [`Error::Config`] if the spec does not fit the model (layers out of
    /// range, embedding not at layer 0, head not after the last layer, no
    /// slots), [`Error::Batch`] for a bad `b`, `t`.
    pub fn new(
        blocks: GptBlocks,
        layout: &ParamLayout,
        spec: StageSpec,
        b: usize,
        t: usize,
        slots: usize,
        split: bool,
    ) -> Result<Self> {
        let cfg: GptConfig = blocks.config().clone();
        let nl = cfg.n_layer;
        let bad = |reason: String| {
            Err(Error::Config {
                field: "pipeline stage",
                reason,
            })
        };
        if spec.layers.start > spec.layers.end || spec.layers.end > nl {
            return bad(format!(
                "layers {:?} outside the model's 0..{nl}",
                spec.layers
            ));
        }
        if spec.embed && spec.layers.start != 0 {
            return bad(format!(
                "the embedding stage must start at layer 0, not {}",
                spec.layers.start
            ));
        }
        if spec.head && spec.layers.end != nl {
            return bad(format!(
                "the head stage must end at layer {nl}, not {}",
                spec.layers.end
            ));
        }
        if spec.layers.is_empty() && !spec.embed && !spec.head {
            return bad("a stage with no layers, embedding or head".into());
        }
        if spec.index >= spec.stages
            || spec.embed != (spec.index == 0)
            || spec.head != (spec.index + 1 == spec.stages)
        {
            return bad(format!(
                "stage {} of {} must hold the embedding exactly when first and the head exactly when last (embed={}, head={})",
                spec.index, spec.stages, spec.embed, spec.head
            ));
        }
        if slots == 0 {
            return bad("at least one micro-batch slot is needed".into());
        }
        if layout.len()
            != blocks.lnf_range().end
                + if cfg.tied_embeddings {
                    0
                } else {
                    blocks.lm_head_len()
                }
        {
            return bad("the layout does not match the per-block functions".into());
        }
        // Local pieces in model order.
        let mut segments = Vec::new();
        let mut at = 0;
        let mut push = |global: Range<usize>| {
            let local = at..at + global.len();
            at += global.len();
            segments.push((local.clone(), global));
            local
        };
        let embed = spec.embed.then(|| push(blocks.embed_range()));
        let layer_ranges: Vec<_> = spec
            .layers
            .clone()
            .map(|l| push(blocks.block_range(l)))
            .collect();
        let lnf = spec.head.then(|| push(blocks.lnf_range()));
        let tied = cfg.tied_embeddings;
        let lm_head = if !spec.head {
            None
        } else if tied {
            embed.as_ref().map(|e| e.start..e.start + blocks.wte_len())
        } else {
            Some(push(blocks.lm_head_range()))
        };
        let n = at;
        let tied_copy = (spec.head && tied && !spec.embed).then(|| vec![0.0; blocks.wte_len()]);
        let globals: Vec<Range<usize>> = segments.iter().map(|(_, g)| g.clone()).collect();
        let own = layout.gather(&globals);
        let exchange = tied && (spec.embed != spec.head);
        let c = cfg.n_embd;
        let slots = (0..slots)
            .map(|_| -> Result<Slot> {
                Ok(Slot {
                    mb: 0,
                    state: SlotState::Free,
                    tokens: vec![0; b * t],
                    input: vec![0.0; b * t * c],
                    layers: spec
                        .layers
                        .clone()
                        .map(|_| blocks.block_acts(b, t))
                        .collect::<Result<_>>()?,
                    head: if spec.head {
                        Some(blocks.head_acts(b, t)?)
                    } else {
                        None
                    },
                    saved: if split {
                        spec.layers
                            .clone()
                            .map(|_| blocks.weight_inputs(b, t))
                            .collect::<Result<_>>()?
                    } else {
                        Vec::new()
                    },
                    dres: vec![0.0; b * t * c],
                    tied_dwte: if exchange && spec.embed {
                        vec![0.0; blocks.wte_len()]
                    } else {
                        Vec::new()
                    },
                    tied_ready: false,
                    loss: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let scratch = blocks.scratch(b, t)?;
        let tied_out = if exchange && spec.head {
            vec![0.0; blocks.wte_len()]
        } else {
            Vec::new()
        };
        Ok(GptStage {
            blocks,
            spec,
            layout: own,
            segments,
            embed,
            layer_ranges,
            lnf,
            lm_head,
            tied_out,
            tied_out_mb: None,
            tied_copy,
            params: vec![0.0; n],
            grads: vec![0.0; n],
            slots,
            scratch,
            b,
            t,
        })
    }

    /// A stage cut from `model`, with a copy of its parameters (and, for a
    /// head stage with tied embeddings, of `wte`).
    ///
    /// # Errors
    /// As for [`new`](Self::new).
    pub fn from_gpt(
        model: &crate::Gpt,
        spec: StageSpec,
        b: usize,
        t: usize,
        slots: usize,
        split: bool,
    ) -> Result<Self> {
        let mut s = Self::new(
            model.blocks().clone(),
            model.layout(),
            spec,
            b,
            t,
            slots,
            split,
        )?;
        s.load_from_full(&model.params)?;
        Ok(s)
    }

    /// Copies this stage's parameters (and the tied `wte` copy) out of a
    /// full-model buffer in [`ParamLayout`] order.
    ///
    /// # Errors
    /// [`Error::Batch`] if `full` is shorter than the layout.
    pub fn load_from_full(&mut self, full: &[f32]) -> Result<()> {
        let need = self.segments.last().map_or(0, |(_, g)| g.end);
        let need = need.max(self.blocks.wte_len());
        if full.len() < need {
            return Err(Error::Batch {
                reason: format!(
                    "full parameter buffer holds {} floats, the stage reads up to {need}",
                    full.len()
                ),
            });
        }
        for (l, g) in &self.segments {
            self.params[l.clone()].copy_from_slice(&full[g.clone()]);
        }
        if let Some(copy) = &mut self.tied_copy {
            let n = copy.len();
            copy.copy_from_slice(&full[..n]);
        }
        Ok(())
    }

    /// Copies `local` (this stage's parameters or gradients, or anything
    /// else in their order) into its place in a full-model buffer.
    ///
    /// # Errors
    /// [`Error::Batch`] on a length mismatch.
    pub fn store_to_full(&self, local: &[f32], full: &mut [f32]) -> Result<()> {
        if local.len() != self.params.len() {
            return Err(Error::Batch {
                reason: format!(
                    "stage buffer holds {} floats, the stage has {}",
                    local.len(),
                    self.params.len()
                ),
            });
        }
        for (l, g) in &self.segments {
            let dst = full.get_mut(g.clone()).ok_or_else(|| Error::Batch {
                reason: format!("full buffer too short for range {g:?}"),
            })?;
            dst.copy_from_slice(&local[l.clone()]);
        }
        Ok(())
    }

    /// (range in [`params`](Self::params), range in the full layout) of
    /// each contiguous piece this stage holds, in model order.
    pub fn segments(&self) -> &[(Range<usize>, Range<usize>)] {
        &self.segments
    }

    /// This stage's tensors under their Hugging Face names, with offsets
    /// into [`params`](Self::params) (for checkpoints and the optimizer's
    /// decay mask).
    pub fn specs(&self) -> &[ParamSpec] {
        self.layout.specs()
    }

    /// This stage's own layout (its tensors, offsets into
    /// [`params`](Self::params)).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// What this stage holds.
    pub fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// The per-block functions.
    pub fn blocks(&self) -> &GptBlocks {
        &self.blocks
    }

    /// Micro-batch shape `(B, T)`.
    pub fn batch_shape(&self) -> (usize, usize) {
        (self.b, self.t)
    }

    /// Floats of one activation or activation-gradient message `(B·T·C)`.
    pub fn message_len(&self) -> usize {
        self.b * self.t * self.blocks.config().n_embd
    }

    /// Number of micro-batch slots planned.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Whether the stage was planned for the split backward
    /// ([`backward_input`](weft_pipeline::Stage::backward_input) then
    /// [`backward_weight`](weft_pipeline::Stage::backward_weight)).
    pub fn splits(&self) -> bool {
        self.slots
            .first()
            .is_some_and(|s| s.saved.len() == self.layer_ranges.len())
    }

    /// The part of [`grads`](Self::grads) that the head's backward writes
    /// (`ln_f`, and `lm_head` when untied), at the end of the buffer; `None`
    /// on a stage without the head. With the split backward it is written
    /// by [`backward_input`](weft_pipeline::Stage::backward_input), the rest by
    /// [`backward_weight`](weft_pipeline::Stage::backward_weight) — except on a single
    /// stage with tied embeddings, where the head's part of `wte` lies in
    /// the rest and is completed by `backward_weight`.
    pub fn head_grad_range(&self) -> Option<Range<usize>> {
        self.lnf.as_ref().map(|l| l.start..self.params.len())
    }

    /// Bytes of activation storage (all slots plus the shared scratch).
    pub fn activation_bytes(&self) -> usize {
        self.slots
            .iter()
            .map(|s| {
                s.layers.iter().map(BlockActs::bytes).sum::<usize>()
                    + s.head.as_ref().map_or(0, HeadActs::bytes)
                    + s.saved.iter().map(WeightInputs::bytes).sum::<usize>()
                    + 4 * (s.tokens.len() + s.input.len() + s.dres.len() + s.tied_dwte.len())
            })
            .sum::<usize>()
            + self.scratch.bytes()
    }

    /// Whether this stage takes part in the tied-embedding gradient
    /// exchange (tied embeddings, and the embedding and head on different
    /// stages): the head stage sends [`tied_wte_grad`](Self::tied_wte_grad),
    /// the embedding stage receives into [`tied_wte_grad_mut`](Self::tied_wte_grad_mut).
    fn tied_exchange(&self) -> bool {
        self.blocks.config().tied_embeddings && self.spec.embed != self.spec.head
    }

    /// The head stage's copy of `wte` (tied embeddings, head without
    /// embedding), to refresh from the embedding stage after each update.
    fn tied_wte_mut(&mut self) -> Option<&mut [f32]> {
        self.tied_copy.as_deref_mut()
    }

    /// The embedding stage's `wte` (the first part of its parameters).
    fn wte(&self) -> Option<&[f32]> {
        self.embed
            .as_ref()
            .map(|e| &self.params[e.start..e.start + self.blocks.wte_len()])
    }

    fn slot_of(&self, mb: usize, state: SlotState, what: &str) -> Result<usize> {
        self.slots
            .iter()
            .position(|s| s.state == state && s.mb == mb)
            .ok_or_else(|| Error::Batch {
                reason: format!(
                    "stage {:?}: {what} of micro-batch {mb}, which is not in the expected state ({state:?})",
                    self.spec.layers
                ),
            })
    }

    /// The head stage's `wte` gradient of micro-batch `mb` (zero-started),
    /// after its [`backward`](weft_pipeline::Stage::backward) or
    /// [`backward_input`](weft_pipeline::Stage::backward_input) and until the next one (the
    /// stage keeps only the latest); `None` otherwise, and unless this is
    /// the head side of a [`tied_exchange`](Self::tied_exchange).
    fn tied_wte_grad(&self, mb: usize) -> Option<&[f32]> {
        (self.tied_out_mb == Some(mb)).then_some(self.tied_out.as_slice())
    }

    /// Where the embedding stage stores the head's `wte` gradient of
    /// micro-batch `mb` before its embedding backward; `None` unless this
    /// is the embedding side of a [`tied_exchange`](Self::tied_exchange)
    /// with `mb` in flight. Marks the gradient as present.
    fn tied_wte_grad_mut(&mut self, mb: usize) -> Option<&mut [f32]> {
        if !(self.tied_exchange() && self.spec.embed) {
            return None;
        }
        let s = self
            .slots
            .iter_mut()
            .find(|s| s.state != SlotState::Free && s.mb == mb)?;
        s.tied_ready = true;
        Some(&mut s.tied_dwte)
    }

    /// Forward of micro-batch `mb`: `input` is the tokens on the embedding
    /// stage and the previous stage's output elsewhere; the head stage
    /// needs `targets` and returns the mean loss. Takes a free slot.
    fn forward_mb(
        &mut self,
        mb: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        if self
            .slots
            .iter()
            .any(|s| s.state != SlotState::Free && s.mb == mb)
        {
            return Err(Error::Batch {
                reason: format!("micro-batch {mb} is already in flight on this stage"),
            });
        }
        if self.spec.head && targets.is_none() {
            return Err(Error::Batch {
                reason: "the head stage's forward needs targets".into(),
            });
        }
        let free = self
            .slots
            .iter()
            .position(|s| s.state == SlotState::Free)
            .ok_or_else(|| Error::Batch {
                reason: format!(
                    "stage {:?}: all {} micro-batch slots in flight (plan more slots for this schedule)",
                    self.spec.layers,
                    self.slots.len()
                ),
            })?;
        let (b, t) = (self.b, self.t);
        let bl = &self.blocks;
        let p = &self.params;
        let slot = &mut self.slots[free];
        match (input, &self.embed) {
            (StageInput::Tokens(tok), Some(e)) => {
                if tok.len() != b * t {
                    return Err(Error::Batch {
                        reason: format!("{} tokens for B*T = {}", tok.len(), b * t),
                    });
                }
                slot.tokens.copy_from_slice(tok);
                bl.embed_forward(&mut slot.input, tok, &p[e.clone()], b, t)?;
            }
            (StageInput::Hidden(x), None) => {
                if x.len() != slot.input.len() {
                    return Err(Error::Batch {
                        reason: format!(
                            "stage input holds {} floats, expected B*T*C = {}",
                            x.len(),
                            slot.input.len()
                        ),
                    });
                }
                slot.input.copy_from_slice(x);
            }
            (StageInput::Tokens(_), None) => {
                return Err(Error::Batch {
                    reason: "tokens given to a stage without the embedding".into(),
                });
            }
            (StageInput::Hidden(_), Some(_)) => {
                return Err(Error::Batch {
                    reason: "hidden states given to the embedding stage".into(),
                });
            }
        }
        for (i, r) in self.layer_ranges.iter().enumerate() {
            let (prev, cur) = slot.layers.split_at_mut(i);
            let inp: &[f32] = if i == 0 {
                &slot.input
            } else {
                &prev[i - 1].out
            };
            bl.block_forward(
                self.spec.layers.start + i,
                &mut cur[0],
                inp,
                &p[r.clone()],
                &mut self.scratch,
            )?;
        }
        slot.loss = None;
        if let (Some(head), Some(lnf)) = (&mut slot.head, &self.lnf) {
            let last = slot.layers.last().map_or(&slot.input, |a| &a.out);
            let lm = match (&self.lm_head, &self.tied_copy) {
                (Some(r), _) => &p[r.clone()],
                (None, Some(copy)) => copy.as_slice(),
                (None, None) => unreachable!("a head stage has a head weight"),
            };
            slot.loss = bl.head_forward(head, last, &p[lnf.clone()], lm, targets)?;
        }
        slot.mb = mb;
        slot.state = SlotState::Forwarded;
        slot.tied_ready = false;
        Ok(slot.loss)
    }

    /// The output `(B,T,C)` of micro-batch `mb`'s forward (to send to the
    /// next stage); `None` if `mb` is not in flight.
    fn output(&self, mb: usize) -> Option<&[f32]> {
        self.slots
            .iter()
            .find(|s| s.state != SlotState::Free && s.mb == mb)
            .map(|s| s.layers.last().map_or(s.input.as_slice(), |a| &a.out))
    }

    /// Head backward (when this is the head stage) or loading `dout`,
    /// leaving d(last layer's output) in the slot's `dres`.
    fn start_backward(&mut self, i: usize, dout: Option<&[f32]>) -> Result<()> {
        let bl = &self.blocks;
        let exchange = self.tied_exchange();
        let slot = &mut self.slots[i];
        match (dout, &mut slot.head) {
            (None, Some(head)) => {
                let lnf = self.lnf.clone().expect("head stage has ln_f");
                let last = slot.layers.last().map_or(&slot.input, |a| &a.out);
                let (params, grads) = (&self.params, &mut self.grads);
                let (dlnf, dlm, lm): (&mut [f32], &mut [f32], &[f32]) =
                    match (&self.lm_head, &self.tied_copy) {
                        (Some(r), _) if !exchange => {
                            if r.start < lnf.start {
                                // Tied on a single stage: wte at the start.
                                let (lo, hi) = grads.split_at_mut(lnf.start);
                                (&mut hi[..lnf.len()], &mut lo[r.clone()], &params[r.clone()])
                            } else {
                                let (lo, hi) = grads.split_at_mut(r.start);
                                (&mut lo[lnf.clone()], &mut hi[..r.len()], &params[r.clone()])
                            }
                        }
                        (_, Some(copy)) => {
                            weft_kernels::zero(&mut self.tied_out);
                            self.tied_out_mb = Some(slot.mb);
                            (&mut grads[lnf.clone()], &mut self.tied_out, copy.as_slice())
                        }
                        _ => unreachable!("a head stage has a head weight"),
                    };
                bl.head_backward(
                    &mut slot.dres,
                    dlnf,
                    dlm,
                    head,
                    last,
                    &params[lnf],
                    lm,
                    &mut self.scratch,
                )?;
            }
            (Some(d), None) => {
                if d.len() != slot.dres.len() {
                    return Err(Error::Batch {
                        reason: format!(
                            "output gradient holds {} floats, expected B*T*C = {}",
                            d.len(),
                            slot.dres.len()
                        ),
                    });
                }
                slot.dres.copy_from_slice(d);
            }
            (None, None) => {
                return Err(Error::Batch {
                    reason: "a stage without the head needs its output's gradient".into(),
                });
            }
            (Some(_), Some(_)) => {
                return Err(Error::Batch {
                    reason: "the head stage starts its backward from the loss, not a gradient"
                        .into(),
                });
            }
        }
        Ok(())
    }

    fn embed_backward(&mut self, i: usize) -> Result<()> {
        let Some(e) = self.embed.clone() else {
            return Ok(());
        };
        let exchange = self.tied_exchange();
        let slot = &mut self.slots[i];
        let g = &mut self.grads[e];
        if exchange {
            if !slot.tied_ready {
                return Err(Error::Batch {
                    reason: format!(
                        "embedding backward of micro-batch {} before the head's wte gradient arrived (tied embeddings)",
                        slot.mb
                    ),
                });
            }
            weft_kernels::accumulate(&mut g[..slot.tied_dwte.len()], &slot.tied_dwte)?;
        }
        self.blocks
            .embed_backward(g, &slot.dres, &slot.tokens, self.b, self.t)
    }

    fn backward_mb(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>> {
        let i = self.slot_of(mb, SlotState::Forwarded, "backward")?;
        self.start_backward(i, dout)?;
        let bl = &self.blocks;
        let slot = &mut self.slots[i];
        for (k, r) in self.layer_ranges.iter().enumerate().rev() {
            let inp: &[f32] = if k == 0 {
                &slot.input
            } else {
                &slot.layers[k - 1].out
            };
            bl.block_backward(
                &mut slot.dres,
                &mut self.grads[r.clone()],
                &slot.layers[k],
                inp,
                &self.params[r.clone()],
                &mut self.scratch,
            )?;
        }
        if self.embed.is_some() {
            self.embed_backward(i)?;
        } else {
            copy_out(dinput, &self.slots[i].dres)?;
        }
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        slot.tied_ready = false;
        Ok(std::iter::once(0..self.grads.len()).collect())
    }

    fn backward_input_mb(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>> {
        let i = self.slot_of(mb, SlotState::Forwarded, "backward-for-input")?;
        if self.slots[i].saved.len() != self.layer_ranges.len() {
            return Err(Error::Batch {
                reason: "backward_input on a stage planned without split backward".into(),
            });
        }
        if self.spec.embed
            && self.spec.head
            && self.blocks.config().tied_embeddings
            && let Some(prev) = self.slots.iter().find(|s| s.state == SlotState::InputDone)
        {
            // The head's wte gradient lands in the embedding's range, which
            // the pending W has not finished: the micro-batches would mix.
            return Err(Error::Batch {
                reason: format!(
                    "with tied embeddings on one stage, W of micro-batch {} must run before the next B (micro-batch {mb})",
                    prev.mb
                ),
            });
        }
        self.start_backward(i, dout)?;
        let bl = &self.blocks;
        let slot = &mut self.slots[i];
        for (k, r) in self.layer_ranges.iter().enumerate().rev() {
            let inp: &[f32] = if k == 0 {
                &slot.input
            } else {
                &slot.layers[k - 1].out
            };
            bl.block_backward_input(
                &mut slot.dres,
                &mut slot.saved[k],
                &slot.layers[k],
                inp,
                &self.params[r.clone()],
                &mut self.scratch,
            )?;
        }
        slot.state = SlotState::InputDone;
        if self.embed.is_none() {
            copy_out(dinput, &self.slots[i].dres)?;
        }
        Ok(self.head_grad_range().into_iter().collect())
    }

    fn backward_weight_mb(&mut self, mb: usize) -> Result<Vec<Range<usize>>> {
        let i = self.slot_of(mb, SlotState::InputDone, "backward-for-weights")?;
        let bl = &self.blocks;
        let slot = &mut self.slots[i];
        for (k, r) in self.layer_ranges.iter().enumerate() {
            let inp: &[f32] = if k == 0 {
                &slot.input
            } else {
                &slot.layers[k - 1].out
            };
            bl.block_backward_weight(
                &mut self.grads[r.clone()],
                &mut slot.saved[k],
                &slot.layers[k],
                inp,
                &self.params[r.clone()],
                &mut self.scratch,
            )?;
        }
        self.embed_backward(i)?;
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        slot.tied_ready = false;
        let end = self.head_grad_range().map_or(self.grads.len(), |r| r.start);
        Ok(std::iter::once(0..end).collect())
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        weft_kernels::zero(&mut self.grads);
    }
}

/// Copies a stage's input gradient to the executor's message buffer.
fn copy_out(dinput: Option<&mut [f32]>, dres: &[f32]) -> Result<()> {
    let Some(out) = dinput else {
        return Err(Error::Batch {
            reason:
                "a stage without the embedding sends its input's gradient back: give it a buffer"
                    .into(),
        });
    };
    if out.len() != dres.len() {
        return Err(Error::Batch {
            reason: format!(
                "input-gradient buffer of {} floats, expected B*T*C = {}",
                out.len(),
                dres.len()
            ),
        });
    }
    out.copy_from_slice(dres);
    Ok(())
}

/// The id of the tied embedding as a [`weft_pipeline::Shared`] parameter.
const TIED_WTE: u32 = 0;

/// A GPT stage runs under `weft-pipeline`'s executor: the embedding stage
/// reads a micro-batch's tokens, the head stage its targets; with tied
/// embeddings across stages `wte` is a [`Shared`](weft_pipeline::Shared)
/// parameter owned by the embedding stage (see the module docs).
impl weft_pipeline::Stage for GptStage {
    type Batch<'a> = MicroBatch<'a>;
    type Error = Error;

    fn input_len(&self) -> usize {
        self.message_len()
    }
    fn output_len(&self) -> usize {
        self.message_len()
    }
    fn slots(&self) -> usize {
        self.slots.len()
    }
    fn splits_backward(&self) -> bool {
        self.splits()
    }

    fn forward(
        &mut self,
        mb: usize,
        batch: &MicroBatch<'_>,
        input: Option<&[f32]>,
        output: Option<&mut [f32]>,
    ) -> Result<Option<f64>> {
        let inp = match input {
            None => StageInput::Tokens(batch.tokens),
            Some(x) => StageInput::Hidden(x),
        };
        let loss = self.forward_mb(mb, inp, self.spec.head.then_some(batch.targets))?;
        if let Some(out) = output {
            let y = self.output(mb).unwrap_or_default();
            if out.len() != y.len() {
                return Err(Error::Batch {
                    reason: format!(
                        "output buffer of {} floats, expected B*T*C = {}",
                        out.len(),
                        y.len()
                    ),
                });
            }
            out.copy_from_slice(y);
        }
        Ok(loss)
    }

    fn backward(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>> {
        self.backward_mb(mb, dout, dinput)
    }

    fn backward_input(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>> {
        self.backward_input_mb(mb, dout, dinput)
    }

    fn backward_weight(&mut self, mb: usize) -> Result<Vec<Range<usize>>> {
        self.backward_weight_mb(mb)
    }

    fn discard(&mut self, mb: usize) -> Result<()> {
        let i = self.slot_of(mb, SlotState::Forwarded, "discard")?;
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        slot.tied_ready = false;
        Ok(())
    }

    fn grads(&self) -> &[f32] {
        &self.grads
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }

    fn shared(&self) -> Vec<weft_pipeline::Shared> {
        if !self.tied_exchange() {
            return Vec::new();
        }
        vec![weft_pipeline::Shared {
            id: TIED_WTE,
            owner: 0,
            user: self.spec.stages - 1,
            len: self.blocks.wte_len(),
        }]
    }

    fn shared_grad(&self, id: u32, mb: usize) -> Option<&[f32]> {
        (id == TIED_WTE).then(|| self.tied_wte_grad(mb)).flatten()
    }

    fn add_shared_grad(&mut self, id: u32, mb: usize, grad: &[f32]) -> Result<()> {
        let layers = self.spec.layers.clone();
        let dst = (id == TIED_WTE)
            .then(|| self.tied_wte_grad_mut(mb))
            .flatten()
            .ok_or_else(|| Error::Batch {
                reason: format!(
                    "stage {layers:?}: no tied wte gradient expected for micro-batch {mb} (shared parameter {id})"
                ),
            })?;
        if dst.len() != grad.len() {
            return Err(Error::Batch {
                reason: format!(
                    "tied wte gradient of {} floats, expected {}",
                    grad.len(),
                    dst.len()
                ),
            });
        }
        dst.copy_from_slice(grad);
        Ok(())
    }

    fn shared_param(&self, id: u32) -> Option<&[f32]> {
        (id == TIED_WTE && self.tied_exchange())
            .then(|| self.wte())
            .flatten()
    }

    fn set_shared_param(&mut self, id: u32, value: &[f32]) -> Result<()> {
        let copy = (id == TIED_WTE)
            .then(|| self.tied_wte_mut())
            .flatten()
            .ok_or_else(|| Error::Batch {
                reason: format!("this stage holds no copy of shared parameter {id}"),
            })?;
        if copy.len() != value.len() {
            return Err(Error::Batch {
                reason: format!(
                    "wte of {} floats, the copy holds {}",
                    value.len(),
                    copy.len()
                ),
            });
        }
        copy.copy_from_slice(value);
        Ok(())
    }
}

/// The stages `rank` holds of `schedule`, cut from `model`: virtual stage
/// `s` holds `layers_per_virtual_stage[s]` layers (in model order, summing
/// to `n_layer`; a `weft_pipeline::Partition`'s `layers_per_chunk`), with
/// parameters copied from `model`, planned for micro-batches of `b`
/// sequences of `t` tokens and the schedule's peak in-flight count (split
/// backward when the schedule splits it). Hand them to
/// [`weft_pipeline::Executor::new`].
///
/// # Errors
/// [`Error::Config`] if the layer counts do not match the schedule's
/// virtual stages or the model, or `rank` is outside the schedule; as
/// [`GptStage::new`] otherwise.
pub fn pipeline_stages(
    model: &crate::Gpt,
    schedule: &weft_pipeline::Schedule,
    rank: usize,
    layers_per_virtual_stage: &[usize],
    b: usize,
    t: usize,
) -> Result<Vec<GptStage>> {
    let pl = schedule.placement();
    let nvs = pl.virtual_stages();
    let total: usize = layers_per_virtual_stage.iter().sum();
    if layers_per_virtual_stage.len() != nvs || total != model.config().n_layer {
        return Err(Error::Config {
            field: "pipeline stages",
            reason: format!(
                "layers per virtual stage {layers_per_virtual_stage:?}: need {nvs} counts summing to n_layer = {}",
                model.config().n_layer
            ),
        });
    }
    if rank >= pl.stages() {
        return Err(Error::Config {
            field: "pipeline stages",
            reason: format!("rank {rank} outside the schedule's {} stages", pl.stages()),
        });
    }
    let peak = weft_pipeline::peak_in_flight_per_chunk(schedule, rank);
    let split = schedule.splits_backward();
    (0..pl.chunks())
        .map(|c| {
            let vs = pl.virtual_stage(rank, c);
            let spec = StageSpec::nth(layers_per_virtual_stage, vs)?;
            GptStage::from_gpt(model, spec, b, t, peak[c].max(1), split)
        })
        .collect()
}
