//! The one block loop: forward and backward of a chunk of the model — the
//! embedding, a contiguous range of blocks, the head, any of them — over
//! parameters that live wherever a [`ParamStore`] keeps them.
//!
//! [`Gpt`](crate::Gpt) runs it over its own resident buffers, a pipeline
//! stage ([`GptStage`](crate::GptStage)) over its stage's, and a fully
//! sharded model over `weft-fsdp`'s gathered units: the store's hooks run
//! around every piece, the way FSDP2 hooks a module, and nothing else
//! differs.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::gpt::{BlockActs, BlockScratch, GptBlocks, HeadActs, WeightInputs};
use crate::stage::StageSpec;

/// A piece of the model, in forward order: the hooks' and the store's
/// unit of parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Piece {
    /// Token and position embeddings (`wte` then `wpe`).
    Embed,
    /// Transformer block `l` (its index in the whole model).
    Block(usize),
    /// The final layernorm (`ln_f`; the output projection is
    /// [`ParamStore::lm_head`]).
    Head,
}

/// The head's parameters and gradients during its backward.
#[derive(Debug)]
pub struct HeadView<'a> {
    /// `ln_f` weight then bias.
    pub lnf: &'a [f32],
    /// The output projection `(V, C)` (`wte` when tied).
    pub lm: &'a [f32],
    /// `ln_f`'s gradient.
    pub dlnf: &'a mut [f32],
    /// The output projection's gradient.
    pub dlm: &'a mut [f32],
}

/// Where a chunk's parameters and gradients are during a step.
///
/// The block loop calls `pre_forward` / `post_forward` around each piece's
/// forward and `pre_backward` / `post_backward` around its backward (for a
/// split backward: around its input half), and in between reads
/// [`params`](Self::params) or writes through [`view`](Self::view). Stores
/// that hold everything resident leave the hooks empty (the defaults); a
/// sharded store gathers a unit in `pre_*`, frees it in `post_*`, and
/// reduce-scatters its gradients in `post_backward`.
pub trait ParamStore {
    /// Before `p`'s forward.
    ///
    /// # Errors
    /// The store's (a failed gather).
    fn pre_forward(&mut self, p: Piece) -> Result<()> {
        let _ = p;
        Ok(())
    }

    /// After `p`'s forward.
    ///
    /// # Errors
    /// The store's.
    fn post_forward(&mut self, p: Piece) -> Result<()> {
        let _ = p;
        Ok(())
    }

    /// Before `p`'s backward.
    ///
    /// # Errors
    /// The store's.
    fn pre_backward(&mut self, p: Piece) -> Result<()> {
        let _ = p;
        Ok(())
    }

    /// After `p`'s backward: its gradients are complete for this
    /// micro-batch.
    ///
    /// # Errors
    /// The store's (a failed reduction).
    fn post_backward(&mut self, p: Piece) -> Result<()> {
        let _ = p;
        Ok(())
    }

    /// `p`'s parameters.
    ///
    /// # Errors
    /// If the store does not hold `p` (or has not gathered it).
    fn params(&self, p: Piece) -> Result<&[f32]>;

    /// The output projection (`wte` when tied).
    ///
    /// # Errors
    /// As [`params`](Self::params).
    fn lm_head(&self) -> Result<&[f32]>;

    /// `p`'s parameters and gradient buffer.
    ///
    /// # Errors
    /// As [`params`](Self::params), or if the store keeps no gradients.
    fn view(&mut self, p: Piece) -> Result<(&[f32], &mut [f32])>;

    /// The head's parameters and gradients together.
    ///
    /// # Errors
    /// As [`view`](Self::view).
    fn head(&mut self) -> Result<HeadView<'_>>;
}

pub(crate) fn missing(what: impl std::fmt::Display) -> Error {
    Error::Batch {
        reason: format!("this store holds no {what}"),
    }
}

/// Where the output projection of a chunk with the head lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Lm {
    /// In the buffer: `wte`'s range when tied (the chunk holds the
    /// embedding), else `lm_head.weight`'s.
    At(Range<usize>),
    /// A copy outside the buffer (a head-only stage of a tied model).
    Copy,
    /// The chunk has no head.
    None,
}

/// The ranges of a chunk's pieces in its own flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PieceRanges {
    pub(crate) embed: Option<Range<usize>>,
    pub(crate) first_layer: usize,
    pub(crate) blocks: Vec<Range<usize>>,
    pub(crate) lnf: Option<Range<usize>>,
    pub(crate) lm: Lm,
}

impl PieceRanges {
    fn range(&self, p: Piece) -> Result<Range<usize>> {
        match p {
            Piece::Embed => self.embed.clone().ok_or_else(|| missing("embedding")),
            Piece::Block(l) => l
                .checked_sub(self.first_layer)
                .and_then(|i| self.blocks.get(i))
                .cloned()
                .ok_or_else(|| missing(format!("block {l}"))),
            Piece::Head => self.lnf.clone().ok_or_else(|| missing("head")),
        }
    }
}

/// A store over resident buffers (a whole model's, or a stage's), with an
/// optional copy of the output projection outside them (a head-only stage
/// of a tied model) and, for forwards, no gradients.
pub(crate) struct Resident<'a> {
    pub(crate) ranges: &'a PieceRanges,
    pub(crate) params: &'a [f32],
    pub(crate) grads: Option<&'a mut [f32]>,
    /// The copy of `wte` and where its gradient goes.
    pub(crate) copy: Option<(&'a [f32], Option<&'a mut [f32]>)>,
}

fn two_mut(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&mut [f32], &mut [f32]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&mut hi[..a.end - a.start], &mut lo[b])
    }
}

impl ParamStore for Resident<'_> {
    fn params(&self, p: Piece) -> Result<&[f32]> {
        Ok(&self.params[self.ranges.range(p)?])
    }

    fn lm_head(&self) -> Result<&[f32]> {
        match (&self.ranges.lm, &self.copy) {
            (Lm::At(r), _) => Ok(&self.params[r.clone()]),
            (Lm::Copy, Some((c, _))) => Ok(c),
            _ => Err(missing("output projection")),
        }
    }

    fn view(&mut self, p: Piece) -> Result<(&[f32], &mut [f32])> {
        let r = self.ranges.range(p)?;
        let g = self
            .grads
            .as_deref_mut()
            .ok_or_else(|| missing("gradients"))?;
        Ok((&self.params[r.clone()], &mut g[r]))
    }

    fn head(&mut self) -> Result<HeadView<'_>> {
        let lnf = self.ranges.lnf.clone().ok_or_else(|| missing("head"))?;
        let g = self
            .grads
            .as_deref_mut()
            .ok_or_else(|| missing("gradients"))?;
        match (&self.ranges.lm, &mut self.copy) {
            (Lm::At(r), _) => {
                let (dlnf, dlm) = two_mut(g, lnf.clone(), r.clone());
                Ok(HeadView {
                    lnf: &self.params[lnf],
                    lm: &self.params[r.clone()],
                    dlnf,
                    dlm,
                })
            }
            (Lm::Copy, Some((c, Some(dc)))) => Ok(HeadView {
                lnf: &self.params[lnf.clone()],
                lm: c,
                dlnf: &mut g[lnf],
                dlm: dc,
            }),
            _ => Err(missing("output projection")),
        }
    }
}

/// What one micro-batch's forward through a chunk keeps for its backward.
#[derive(Debug)]
pub(crate) struct ChunkActs {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) tokens: Vec<u32>, // (B,T·cp) on the embedding chunk: whole sequences
    pub(crate) input: Vec<f32>,  // (rows,C) the embedding's output or the received input
    pub(crate) layers: Vec<BlockActs>, // one per block of the chunk (a recomputed one: its output)
    pub(crate) docs: Vec<u32>,   // (B,T) document starts, kept for recomputation under masking
    pub(crate) head: Option<HeadActs>,
    pub(crate) saved: Vec<WeightInputs>, // per block, for a split backward
    pub(crate) dres: Vec<f32>,           // (rows,C) gradient of the residual stream
}

impl ChunkActs {
    /// Plans a chunk's activations for `b`×`t` tokens; `split` plans what
    /// the input half of the backward saves for the weight half.
    pub(crate) fn new(
        bl: &GptBlocks,
        spec: &StageSpec,
        b: usize,
        t: usize,
        split: bool,
    ) -> Result<Self> {
        let nc = bl.residual_len(b, t);
        Ok(ChunkActs {
            b,
            t,
            tokens: if spec.embed {
                vec![0; b * bl.whole_seq(t)]
            } else {
                Vec::new()
            },
            input: vec![0.0; nc],
            layers: spec
                .layers
                .clone()
                .map(|l| bl.block_acts_for(l, b, t))
                .collect::<Result<_>>()?,
            docs: if keeps_docs(bl, spec) {
                vec![0; b * t]
            } else {
                Vec::new()
            },
            head: if spec.head {
                Some(bl.head_acts(b, t)?)
            } else {
                None
            },
            saved: if split {
                spec.layers
                    .clone()
                    .map(|_| bl.weight_inputs(b, t))
                    .collect::<Result<_>>()?
            } else {
                Vec::new()
            },
            dres: vec![0.0; nc],
        })
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.layers.iter().map(BlockActs::bytes).sum::<usize>()
            + self.head.as_ref().map_or(0, HeadActs::bytes)
            + self.saved.iter().map(WeightInputs::bytes).sum::<usize>()
            + 4 * (self.tokens.len() + self.docs.len() + self.input.len() + self.dres.len())
    }

    /// The chunk's output: the last block's (or the input, for a chunk of
    /// no blocks).
    pub(crate) fn output(&self) -> &[f32] {
        self.layers.last().map_or(&self.input, |a| &a.out)
    }
}

/// Whether a chunk keeps its micro-batch's document starts for the
/// backward: it recomputes a block under document masking.
pub(crate) fn keeps_docs(bl: &GptBlocks, spec: &StageSpec) -> bool {
    bl.doc_boundary().is_some() && bl.recompute().any(spec.layers.clone())
}

/// Runs `f` with the working buffers' [`BlockActs`] for recomputation
/// (planned by [`GptBlocks::scratch`] when the blocks recompute any).
fn with_replay<R>(
    scratch: &mut BlockScratch,
    f: impl FnOnce(&mut BlockActs, &mut BlockScratch) -> Result<R>,
) -> Result<R> {
    let mut replay = scratch.replay.take().ok_or_else(|| Error::Batch {
        reason: "a block recomputes but the working buffers were planned without \
                 recomputation: plan them after set_recompute"
            .into(),
    })?;
    let r = f(&mut replay, scratch);
    scratch.replay = Some(replay);
    r
}

/// What enters a chunk's forward.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ChunkInput<'a> {
    /// Token ids `(B,T)`, for the chunk with the embedding.
    Tokens(&'a [u32]),
    /// The previous chunk's output `(B,T,C)`.
    Hidden(&'a [f32]),
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Batch {
            reason: format!("{what} holds {got} values, expected {want}"),
        })
    }
}

/// Forward of one micro-batch through the chunk `spec`; with the head and
/// `targets`, the mean loss. `tokens` is the micro-batch's tokens `(B,T)`,
/// which every chunk reads under document masking (for the mask); without
/// it, only the embedding chunk reads them (from `input`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    bl: &GptBlocks,
    spec: &StageSpec,
    store: &mut dyn ParamStore,
    acts: &mut ChunkActs,
    scratch: &mut BlockScratch,
    input: ChunkInput<'_>,
    tokens: &[u32],
    targets: Option<&[u32]>,
) -> Result<Option<f64>> {
    let (b, t) = (acts.b, acts.t);
    let docs = bl.row_starts(tokens, b, t)?;
    if let (ChunkInput::Tokens(tok), true) = (&input, spec.embed) {
        check_len("tokens", tok.len(), b * bl.whole_seq(t))?;
    }
    let targets = match targets {
        Some(tg) => {
            check_len("targets", tg.len(), b * bl.whole_seq(t))?;
            Some(bl.local_rows(tg, b, t)?)
        }
        None => None,
    };
    match (input, spec.embed) {
        (ChunkInput::Tokens(tok), true) => {
            acts.tokens.copy_from_slice(tok);
            store.pre_forward(Piece::Embed)?;
            bl.embed_forward(&mut acts.input, tok, store.params(Piece::Embed)?, b, t)?;
            store.post_forward(Piece::Embed)?;
        }
        (ChunkInput::Hidden(x), false) => {
            check_len("the stage's input", x.len(), acts.input.len())?;
            acts.input.copy_from_slice(x);
        }
        (ChunkInput::Tokens(_), false) => {
            return Err(Error::Batch {
                reason: "tokens given to a stage without the embedding".into(),
            });
        }
        (ChunkInput::Hidden(_), true) => {
            return Err(Error::Batch {
                reason: "hidden states given to the embedding stage".into(),
            });
        }
    }
    for (i, l) in spec.layers.clone().enumerate() {
        let (prev, cur) = acts.layers.split_at_mut(i);
        let inp: &[f32] = if i == 0 {
            &acts.input
        } else {
            &prev[i - 1].out
        };
        store.pre_forward(Piece::Block(l))?;
        let p = store.params(Piece::Block(l))?;
        if bl.recompute().recomputes(l) {
            // forward into the shared buffers; keep only the output
            with_replay(scratch, |r, scratch| {
                bl.block_forward(l, r, inp, p, docs.as_deref(), scratch)?;
                std::mem::swap(&mut r.out, &mut cur[0].out);
                Ok(())
            })?;
        } else {
            bl.block_forward(l, &mut cur[0], inp, p, docs.as_deref(), scratch)?;
        }
        store.post_forward(Piece::Block(l))?;
    }
    if !acts.docs.is_empty()
        && let Some(d) = &docs
    {
        acts.docs.copy_from_slice(d);
    }
    let Some(head) = &mut acts.head else {
        return Ok(None);
    };
    let last = acts.layers.last().map_or(&acts.input, |a| &a.out);
    store.pre_forward(Piece::Head)?;
    let loss = bl.head_forward(
        head,
        last,
        store.params(Piece::Head)?,
        store.lm_head()?,
        targets.as_deref(),
    )?;
    store.post_forward(Piece::Head)?;
    Ok(loss)
}

/// The head's backward (from the loss) or the received output gradient,
/// into `acts.dres`.
fn start_backward(
    bl: &GptBlocks,
    store: &mut dyn ParamStore,
    acts: &mut ChunkActs,
    scratch: &mut BlockScratch,
    dout: Option<&[f32]>,
) -> Result<()> {
    match (dout, &mut acts.head) {
        (None, Some(head)) => {
            let last = acts.layers.last().map_or(&acts.input, |a| &a.out);
            store.pre_backward(Piece::Head)?;
            let h = store.head()?;
            bl.head_backward(
                &mut acts.dres,
                h.dlnf,
                h.dlm,
                head,
                last,
                h.lnf,
                h.lm,
                scratch,
            )?;
            store.post_backward(Piece::Head)
        }
        (Some(d), None) => {
            check_len("output gradient", d.len(), acts.dres.len())?;
            acts.dres.copy_from_slice(d);
            Ok(())
        }
        (None, None) => Err(Error::Batch {
            reason: "a stage without the head needs its output's gradient".into(),
        }),
        (Some(_), Some(_)) => Err(Error::Batch {
            reason: "the head stage starts its backward from the loss, not a gradient".into(),
        }),
    }
}

/// The embedding's backward: `extra` (another stage's part of `wte`'s
/// gradient) is added first, then the embedding's own part.
fn embed_backward(
    bl: &GptBlocks,
    store: &mut dyn ParamStore,
    acts: &ChunkActs,
    extra: Option<&[f32]>,
) -> Result<()> {
    store.pre_backward(Piece::Embed)?;
    let (_, g) = store.view(Piece::Embed)?;
    if let Some(x) = extra {
        weft_kernels::accumulate(&mut g[..x.len()], x)?;
    }
    bl.embed_backward(g, &acts.dres, &acts.tokens, acts.b, acts.t)?;
    store.post_backward(Piece::Embed)
}

/// Runs `f` (a backward half of block `l`) on the block's activations:
/// `kept` as the forward left them, or, for a block that recomputes,
/// its forward run again from `inp` into the working buffers' own.
#[allow(clippy::too_many_arguments)]
fn replayed(
    bl: &GptBlocks,
    l: usize,
    kept: &BlockActs,
    inp: &[f32],
    p: &[f32],
    docs: &[u32],
    scratch: &mut BlockScratch,
    f: impl FnOnce(&BlockActs, &mut BlockScratch) -> Result<()>,
) -> Result<()> {
    if !bl.recompute().recomputes(l) {
        return f(kept, scratch);
    }
    let docs = (!docs.is_empty()).then_some(docs);
    with_replay(scratch, |r, scratch| {
        bl.block_replay(l, r, inp, p, docs, scratch)?;
        f(r, scratch)
    })
}

/// The whole backward of the micro-batch in `acts` (`dout`: the gradient
/// of the chunk's output, `None` with the head); afterwards `acts.dres`
/// holds the gradient of the chunk's input. `extra`: as [`embed_backward`].
pub(crate) fn backward(
    bl: &GptBlocks,
    spec: &StageSpec,
    store: &mut dyn ParamStore,
    acts: &mut ChunkActs,
    scratch: &mut BlockScratch,
    dout: Option<&[f32]>,
    extra: Option<&[f32]>,
) -> Result<()> {
    start_backward(bl, store, acts, scratch, dout)?;
    for (i, l) in spec.layers.clone().enumerate().rev() {
        let inp: &[f32] = if i == 0 {
            &acts.input
        } else {
            &acts.layers[i - 1].out
        };
        store.pre_backward(Piece::Block(l))?;
        let (p, g) = store.view(Piece::Block(l))?;
        replayed(
            bl,
            l,
            &acts.layers[i],
            inp,
            p,
            &acts.docs,
            scratch,
            |a, s| bl.block_backward(&mut acts.dres, g, a, inp, p, s),
        )?;
        store.post_backward(Piece::Block(l))?;
    }
    if spec.embed {
        embed_backward(bl, store, acts, extra)?;
    }
    Ok(())
}

/// The input half (B) of [`backward`]: the head's whole backward, each
/// block's input gradient (saving what its weight gradient needs).
pub(crate) fn backward_input(
    bl: &GptBlocks,
    spec: &StageSpec,
    store: &mut dyn ParamStore,
    acts: &mut ChunkActs,
    scratch: &mut BlockScratch,
    dout: Option<&[f32]>,
) -> Result<()> {
    if acts.saved.len() != acts.layers.len() {
        return Err(Error::Batch {
            reason: "backward_input on a stage planned without split backward".into(),
        });
    }
    start_backward(bl, store, acts, scratch, dout)?;
    for (i, l) in spec.layers.clone().enumerate().rev() {
        let inp: &[f32] = if i == 0 {
            &acts.input
        } else {
            &acts.layers[i - 1].out
        };
        store.pre_backward(Piece::Block(l))?;
        let p = store.params(Piece::Block(l))?;
        let saved = &mut acts.saved[i];
        replayed(
            bl,
            l,
            &acts.layers[i],
            inp,
            p,
            &acts.docs,
            scratch,
            |a, s| bl.block_backward_input(&mut acts.dres, saved, a, inp, p, s),
        )?;
    }
    Ok(())
}

/// The weight half (W) of [`backward`], after [`backward_input`].
pub(crate) fn backward_weight(
    bl: &GptBlocks,
    spec: &StageSpec,
    store: &mut dyn ParamStore,
    acts: &mut ChunkActs,
    scratch: &mut BlockScratch,
    extra: Option<&[f32]>,
) -> Result<()> {
    for (i, l) in spec.layers.clone().enumerate() {
        let inp: &[f32] = if i == 0 {
            &acts.input
        } else {
            &acts.layers[i - 1].out
        };
        let (p, g) = store.view(Piece::Block(l))?;
        let saved = &mut acts.saved[i];
        replayed(
            bl,
            l,
            &acts.layers[i],
            inp,
            p,
            &acts.docs,
            scratch,
            |a, s| bl.block_backward_weight(g, saved, a, inp, p, s),
        )?;
        store.post_backward(Piece::Block(l))?;
    }
    if spec.embed {
        embed_backward(bl, store, acts, extra)?;
    }
    Ok(())
}
