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
use std::sync::Arc;

use weft_collectives::Communicator;
use weft_kernels::{OptimStep, Precision};
use weft_parallel::{
    AdamWState, DimSet, GradNorm, GradReducer, MuonPlan, ParallelMesh, ParamLayout, ParamSpec,
};

use crate::chunk::{self, ChunkActs, ChunkInput, Lm, ParamStore, PieceRanges, Resident};
use crate::error::{Error, Result};
use crate::fsdp::{Sharded, UnitMap};
use crate::gpt::{BlockScratch, GptBlocks, MicroBatch};
use crate::memory::RankMemory;

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
    /// The whole model as one stage: the embedding, every one of
    /// `n_layer` blocks, the head.
    pub fn whole(n_layer: usize) -> Self {
        StageSpec {
            layers: 0..n_layer,
            embed: true,
            head: true,
            index: 0,
            stages: 1,
        }
    }

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
    acts: ChunkActs,
    tied_dwte: Vec<f32>, // (V,C) when the tied-embedding exchange applies
    tied_ready: bool,
}

/// A chunk's pieces in its own buffer: the embedding, its blocks, the
/// head, each as (local range, range in the rank's whole-model layout).
struct Pieces {
    segments: Vec<(Range<usize>, Range<usize>)>,
    ranges: PieceRanges,
    layout: ParamLayout,
    /// Parameters of the chunk.
    len: usize,
    /// A head chunk without the embedding, with tied embeddings: it keeps
    /// a copy of `wte`.
    tied_copy: bool,
    /// The tied-embedding exchange applies (embedding and head apart).
    exchange: bool,
}

impl Pieces {
    /// Checks `spec` against the model and lays its pieces out.
    fn plan(blocks: &GptBlocks, spec: &StageSpec) -> Result<Pieces> {
        let cfg = blocks.config();
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
        let lm = if !spec.head {
            Lm::None
        } else if tied {
            match &embed {
                Some(e) => Lm::At(e.start..e.start + blocks.wte_len()),
                None => Lm::Copy,
            }
        } else {
            Lm::At(push(blocks.lm_head_range()))
        };
        let n = at;
        let tied_copy = spec.head && tied && !spec.embed;
        let globals: Vec<Range<usize>> = segments.iter().map(|(_, g)| g.clone()).collect();
        let layout = blocks.layout().gather(&globals);
        let exchange = tied && (spec.embed != spec.head);
        Ok(Pieces {
            segments,
            ranges: PieceRanges {
                embed,
                first_layer: spec.layers.start,
                blocks: layer_ranges,
                lnf,
                lm,
            },
            layout,
            len: n,
            tied_copy,
            exchange,
        })
    }
}

/// One contiguous run of a tensor that a rank writes to a sharded
/// checkpoint ([`GptStage::owned_parts`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedPart {
    /// The tensor (Hugging Face name).
    pub name: String,
    /// The whole tensor's shape.
    pub global_shape: Vec<usize>,
    /// The run's first element in the whole tensor (row-major).
    pub whole: usize,
    /// The run's parameters and AdamW moments (`m`, `v`).
    pub values: [Vec<f32>; 3],
}

/// What [`GptStage::for_each_owned`] calls with each run a rank owns:
/// its tensor, its first element in the whole tensor, and its
/// parameters' and AdamW moments' values.
type OwnedVisitor<'a> = dyn FnMut(&ParamSpec, usize, [&[f32]; 3]) + 'a;

/// Reads a whole tensor of a checkpoint: `(which, name, out)`, `which` 0
/// for the parameters, 1 and 2 for the AdamW moments.
pub type ReadTensor<'a> = dyn FnMut(
        usize,
        &str,
        &mut [f32],
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>
    + 'a;

/// Where a stage's parameters, gradients and optimizer state live.
#[derive(Debug)]
enum Store {
    /// Resident buffers in the stage's own layout, AdamW moments beside
    /// them, and (with [`GptStage::set_reducer`]) the data-parallel
    /// reducer its gradients are folded into.
    Resident {
        params: Vec<f32>,
        grads: Vec<f32>,
        opt: AdamWState,
        reducer: Option<GradReducer>,
    },
    /// Fully sharded over a data-parallel group (`weft-fsdp`); on the
    /// embedding's stage of a pipeline with tied embeddings, `wte`
    /// gathered after each update for the head stage's copy.
    Sharded {
        fsdp: Box<weft_fsdp::Fsdp>,
        map: UnitMap,
        wte: Option<Vec<f32>>,
        /// With expert parallelism: the expert group, over which the
        /// tensors it replicates are summed before FSDP.
        ep: Option<ExpertGroup>,
    },
}

/// The expert group of a sharded stage and whether its sums are exact.
struct ExpertGroup {
    comm: Arc<dyn Communicator>,
    exact: bool,
}

impl std::fmt::Debug for ExpertGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertGroup")
            .field("size", &self.comm.size())
            .field("exact", &self.exact)
            .finish()
    }
}

/// One chunk of a GPT — the embedding, a contiguous range of blocks, the
/// head, any of them — with its parameters and the activations of `slots`
/// micro-batches in flight, each of `B` sequences of `T` tokens: a stage
/// of `weft-pipeline`'s executor (see the module docs), and, as the
/// whole model on one stage, what every layout of `weft train` runs.
///
/// Its parameters are resident (with AdamW moments and, optionally, the
/// data-parallel [`GradReducer`] its gradients fold into as each
/// micro-batch finishes) or fully sharded over a data-parallel group
/// ([`shard`](Self::shard)); the same block loop runs over either.
///
/// Micro-batches are named by their index; [`forward`](weft_pipeline::Stage::forward)
/// takes a free slot for it, and the last backward step
/// ([`backward`](weft_pipeline::Stage::backward), or [`backward_weight`](weft_pipeline::Stage::backward_weight)
/// after [`backward_input`](weft_pipeline::Stage::backward_input)) frees it. Gradients
/// accumulate (`+=`) with the same kernel calls as
/// [`Gpt::backward`](crate::Gpt::backward).
///
/// The head's weight gradients (`ln_f`, `lm_head`) are computed in
/// `backward_input`: splitting them would cost a second `V`-wide GEMM.
#[derive(Debug)]
pub struct GptStage {
    blocks: GptBlocks,
    spec: StageSpec,
    layout: ParamLayout,
    /// (local range, range in the rank's whole-model layout) of each piece.
    segments: Vec<(Range<usize>, Range<usize>)>,
    ranges: PieceRanges,
    store: Store,
    tied_copy: Option<Vec<f32>>,
    /// Head side of the tied exchange: the latest micro-batch's head `wte`
    /// gradient, and which micro-batch it belongs to.
    tied_out: Vec<f32>,
    tied_out_mb: Option<usize>,
    slots: Vec<Slot>,
    scratch: BlockScratch,
    b: usize,
    t: usize,
    split: bool,
    /// Whether forwards are evaluation (no backward follows).
    eval: bool,
    /// With Muon ([`use_muon`](Self::use_muon)): its plan over this
    /// stage's buffers, and Newton–Schulz's precision.
    muon: Option<(MuonPlan, Precision)>,
}

impl GptStage {
    /// A stage of a model whose parameters (on this rank) follow
    /// `blocks.layout()`, planned for `slots` micro-batches of `b`×`t`
    /// tokens in flight; `split` plans what
    /// [`backward_input`](weft_pipeline::Stage::backward_input) saves for
    /// [`backward_weight`](weft_pipeline::Stage::backward_weight) (per
    /// layer per slot, 7·B·T·C floats plus the feed-forward block's own:
    /// 11·B·T·C with the dense MLP). Parameters start at zero: load them
    /// with [`load_state`](Self::load_state).
    ///
    /// # Errors
    /// [`Error::Config`] if the spec does not fit the model (layers out of
    /// range, embedding not at layer 0, head not after the last layer, no
    /// slots), [`Error::Batch`] for a bad `b`, `t`.
    pub fn new(
        blocks: GptBlocks,
        spec: StageSpec,
        b: usize,
        t: usize,
        slots: usize,
        split: bool,
    ) -> Result<Self> {
        if slots == 0 {
            return Err(Error::Config {
                field: "pipeline stage",
                reason: "at least one micro-batch slot is needed".into(),
            });
        }
        let Pieces {
            segments,
            ranges,
            layout,
            len: n,
            tied_copy,
            exchange,
        } = Pieces::plan(&blocks, &spec)?;
        let tied_copy = tied_copy.then(|| vec![0.0; blocks.wte_len()]);
        let (embed, layer_ranges, lnf, lm) = (ranges.embed, ranges.blocks, ranges.lnf, ranges.lm);
        let slots = (0..slots)
            .map(|_| -> Result<Slot> {
                Ok(Slot {
                    mb: 0,
                    state: SlotState::Free,
                    acts: ChunkActs::new(&blocks, &spec, b, t, split)?,
                    tied_dwte: if exchange && spec.embed {
                        vec![0.0; blocks.wte_len()]
                    } else {
                        Vec::new()
                    },
                    tied_ready: false,
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
            ranges: PieceRanges {
                embed,
                first_layer: spec.layers.start,
                blocks: layer_ranges,
                lnf,
                lm,
            },
            blocks,
            spec,
            layout,
            segments,
            store: Store::Resident {
                params: vec![0.0; n],
                grads: vec![0.0; n],
                opt: AdamWState::zeros(n),
                reducer: None,
            },
            tied_out,
            tied_out_mb: None,
            tied_copy,
            slots,
            scratch,
            b,
            t,
            split,
            eval: false,
            muon: None,
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
        let mut s = Self::new(model.blocks().clone(), spec, b, t, slots, split)?;
        let zeros = vec![0.0; model.params.len()];
        s.load_state(model.layout(), &model.params, &zeros, &zeros, 0)?;
        Ok(s)
    }

    /// Replaces the resident parameters by a data-parallel FSDP of them
    /// over the mesh's data-parallel group (collective over it: every rank
    /// calls it), cut into the stage's pieces — the embedding, each block,
    /// the head — the embedding kept gathered until its backward when the
    /// head reads it. The AdamW state moves to the shards.
    ///
    /// With expert parallelism the stage is sharded over the replicas of
    /// its expert group (`edp`): the experts are the same there, and the
    /// tensors replicated over the expert group (everything but the
    /// experts) have their gradients summed over it before FSDP reduces
    /// them — so each rank holds `1/edp` of the stage.
    ///
    /// # Errors
    /// [`Error::Config`] if the stage is already sharded; FSDP's errors.
    pub fn shard(&mut self, mesh: &ParallelMesh, cfg: weft_fsdp::FsdpConfig) -> Result<()> {
        if self.muon.is_some() {
            return Err(Error::Config {
                field: "fsdp",
                reason: "shard a stage before planning Muon over it".into(),
            });
        }
        let Store::Resident { params, opt, .. } = &self.store else {
            return Err(Error::Config {
                field: "fsdp",
                reason: "the stage is sharded already".into(),
            });
        };
        let dims = mesh.dims();
        let experts = dims.ep > 1;
        let reproducible = cfg.reproducible;
        let (units, map) =
            crate::fsdp::units(&self.ranges, &self.layout, self.blocks.wte_len(), experts);
        // sharded over the ranks holding the same parameters: the
        // data-parallel group (an expert group's replicas) with the
        // context-parallel ranks
        let group = mesh.group(if experts { DimSet::EDP } else { DimSet::DP }.with(DimSet::CP));
        let mut fsdp = weft_fsdp::Fsdp::new(group, &self.layout, units, cfg, params)?;
        if experts {
            fsdp.set_data_parallel_size(dims.dp * dims.cp)?;
        }
        fsdp.load_whole(params, &opt.m, &opt.v, opt.step)?;
        fsdp.record_activations(self.activation_bytes());
        self.store = Store::Sharded {
            fsdp: Box::new(fsdp),
            map,
            wte: None,
            ep: experts.then(|| ExpertGroup {
                comm: mesh.group_arc(DimSet::EP),
                exact: reproducible,
            }),
        };
        self.refresh_shared_wte()
    }

    /// Replaces this rank's parameters and AdamW moments (in its own
    /// layout) and the optimizer step: the resident buffers, or FSDP's
    /// shards of them.
    fn set_state(&mut self, [lp, lm, lv]: [Vec<f32>; 3], step: u32) -> Result<()> {
        match &mut self.store {
            Store::Resident { params, opt, .. } => {
                *params = lp;
                opt.m = lm;
                opt.v = lv;
                opt.step = step;
            }
            Store::Sharded { fsdp, .. } => fsdp.load_whole(&lp, &lm, &lv, step)?,
        }
        self.refresh_shared_wte()
    }

    /// On a sharded embedding stage whose `wte` the head stage copies
    /// (tied embeddings across stages): gathers `wte` for the exchange.
    /// Collective over the data-parallel group.
    fn refresh_shared_wte(&mut self) -> Result<()> {
        let owner = self.tied_exchange() && self.spec.embed;
        let w = self.blocks.wte_len();
        if let Store::Sharded { fsdp, wte, .. } = &mut self.store
            && owner
        {
            let mut full = fsdp.unit_params(0)?;
            full.truncate(w);
            *wte = Some(full);
        }
        Ok(())
    }

    /// The FSDP state, when the stage is sharded.
    pub fn fsdp(&self) -> Option<&weft_fsdp::Fsdp> {
        match &self.store {
            Store::Sharded { fsdp, .. } => Some(fsdp),
            Store::Resident { .. } => None,
        }
    }

    /// The FSDP state, mutably (spans, memory peaks).
    pub fn fsdp_mut(&mut self) -> Option<&mut weft_fsdp::Fsdp> {
        match &mut self.store {
            Store::Sharded { fsdp, .. } => Some(fsdp),
            Store::Resident { .. } => None,
        }
    }

    /// Folds each micro-batch's gradients into `reducer` as they become
    /// final (the data-parallel reduction; resident stages only): exact
    /// partial sums in reproducible mode, in place otherwise.
    ///
    /// # Errors
    /// [`Error::Config`] for a sharded stage (FSDP reduces its own).
    pub fn set_reducer(&mut self, reducer: GradReducer) -> Result<()> {
        match &mut self.store {
            Store::Resident { reducer: r, .. } => {
                *r = Some(reducer);
                Ok(())
            }
            Store::Sharded { .. } => Err(Error::Config {
                field: "fsdp",
                reason: "a sharded stage reduces its gradients itself".into(),
            }),
        }
    }

    /// Copies this stage's share of a whole model's state — parameters and
    /// AdamW moments laid out by `whole` (the unsharded model's layout;
    /// this stage takes its tensors, cut by their tensor- and
    /// expert-parallel placements: `weft_parallel::extract`) — and the
    /// optimizer step; a head stage with tied embeddings also takes its
    /// copy of (its share of) `wte`. Collective over the data-parallel
    /// group when the stage is sharded.
    ///
    /// # Errors
    /// [`Error::Parallel`] if a buffer does not fit its layout; FSDP's.
    pub fn load_state(
        &mut self,
        whole: &ParamLayout,
        params: &[f32],
        m: &[f32],
        v: &[f32],
        step: u32,
    ) -> Result<()> {
        let mut local: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0.0; self.layout.len()]);
        for (src, dst) in [params, m, v].into_iter().zip(local.iter_mut()) {
            weft_parallel::extract(&self.layout, whole, src, dst)?;
        }
        if let Some(copy) = &mut self.tied_copy {
            let wte = self
                .blocks
                .layout()
                .sub(self.blocks.embed_range().start..self.blocks.wte_len());
            weft_parallel::extract(&wte, whole, params, copy)?;
        }
        self.set_state(local, step)
    }

    /// GPT-2's initialisation of this stage's part of the model from
    /// `seed` ([`crate::init_gpt2`]: the values the whole model has there),
    /// zero moments, step 0 — without the whole model. Before
    /// [`shard`](Self::shard).
    ///
    /// # Errors
    /// [`Error::Config`] for a sharded stage; a layout error.
    pub fn init_gpt2(&mut self, seed: u64) -> Result<()> {
        let n_layer = self.blocks.config().n_layer;
        let Store::Resident { params, opt, .. } = &mut self.store else {
            return Err(Error::Config {
                field: "init",
                reason: "initialise a stage before sharding it".into(),
            });
        };
        crate::init::init_gpt2(&self.layout, params, seed, n_layer)?;
        *opt = AdamWState::zeros(params.len());
        if let Some(copy) = &mut self.tied_copy {
            let wte = self
                .blocks
                .layout()
                .sub(self.blocks.embed_range().start..self.blocks.wte_len());
            crate::init::init_gpt2(&wte, copy, seed, n_layer)?;
        }
        Ok(())
    }

    /// This stage's parameters and AdamW moments, whole (in
    /// [`layout`](Self::layout)), and the optimizer step — what a
    /// checkpoint of the stage holds. Collective over the data-parallel
    /// group when the stage is sharded (the shards are all-gathered).
    ///
    /// # Errors
    /// FSDP's.
    pub fn state(&self) -> Result<([Vec<f32>; 3], u32)> {
        match &self.store {
            Store::Resident { params, opt, .. } => {
                Ok(([params.clone(), opt.m.clone(), opt.v.clone()], opt.step))
            }
            Store::Sharded { fsdp, .. } => Ok((fsdp.unshard_state()?, fsdp.optimizer_step())),
        }
    }

    /// The parts of this stage's tensors this rank writes to a sharded
    /// checkpoint — its parameters' and AdamW moments' values — chosen so
    /// that over every rank of the mesh each element of the model is
    /// written exactly once: a resident stage's tensors by the first of the
    /// ranks holding the same part (`MeshCoords::owns`), a sharded stage's
    /// FSDP shards by the first of their replicas. No communication.
    ///
    /// # Errors
    /// A layout error.
    pub fn owned_parts(&self, coords: &weft_parallel::MeshCoords) -> Result<Vec<OwnedPart>> {
        let mut out = Vec::new();
        self.owned_parts_into(coords, &mut out, &mut 0)?;
        Ok(out)
    }

    /// [`owned_parts`](Self::owned_parts) into `out` from index `*at` on
    /// (advanced past them): a part already there for the same run is
    /// overwritten in place, so a loop that saves again and again copies
    /// into memory it already holds.
    ///
    /// # Errors
    /// A layout error.
    pub fn owned_parts_into(
        &self,
        coords: &weft_parallel::MeshCoords,
        out: &mut Vec<OwnedPart>,
        at: &mut usize,
    ) -> Result<()> {
        self.for_each_owned(coords, &mut |spec, whole, values| {
            let same = |p: &OwnedPart| {
                p.name == spec.name && p.whole == whole && p.values[0].len() == values[0].len()
            };
            match out.get_mut(*at) {
                Some(p) if same(p) => {
                    for (d, s) in p.values.iter_mut().zip(values) {
                        d.copy_from_slice(s);
                    }
                }
                slot => {
                    let part = OwnedPart {
                        name: spec.name.clone(),
                        global_shape: spec.global_shape.clone(),
                        whole,
                        values: values.map(<[f32]>::to_vec),
                    };
                    match slot {
                        Some(p) => *p = part,
                        None => out.push(part),
                    }
                }
            }
            *at += 1;
        })
    }

    /// The values of [`owned_parts`](Self::owned_parts), counted without
    /// copying them (a part holds its elements three times: parameters
    /// and both AdamW moments; twice for Muon's matrices: parameters and
    /// momentum).
    ///
    /// # Errors
    /// A layout error.
    pub fn owned_elements(&self, coords: &weft_parallel::MeshCoords) -> Result<usize> {
        let mut n = 0;
        self.for_each_owned(coords, &mut |_, _, [p, m, v]| {
            n += p.len() + m.len() + v.len();
        })?;
        Ok(n)
    }

    /// Calls `f(spec, whole, [params, m, v])` for every run
    /// [`owned_parts`](Self::owned_parts) copies, `whole` its first
    /// element in the whole tensor.
    fn for_each_owned(
        &self,
        coords: &weft_parallel::MeshCoords,
        f: &mut OwnedVisitor<'_>,
    ) -> Result<()> {
        let sharding = self.layout.coords();
        match &self.store {
            Store::Resident { params, opt, .. } => {
                for spec in self.layout.specs() {
                    if !coords.owns(spec) {
                        continue;
                    }
                    // (copied key/value heads by the first of their ranks)
                    let muon = self.is_muon(&spec.range());
                    for run in spec.first_runs(&sharding)? {
                        let l = spec.offset + run.local..spec.offset + run.local + run.len;
                        let v = if muon { &[][..] } else { &opt.v[l.clone()] };
                        f(spec, run.whole, [&params[l.clone()], &opt.m[l], v]);
                    }
                }
            }
            Store::Sharded { fsdp, .. } => {
                // the first of a shard's replicas (hybrid sharding's
                // replicate groups) writes it
                if fsdp.dp_rank() / fsdp.shard_size() != 0 {
                    return Ok(());
                }
                let rank = fsdp.shard_rank();
                for (u, unit) in fsdp.plan().units().iter().enumerate() {
                    let held = unit.shard_in_model(rank);
                    let shard_start = unit.range.start + unit.shard(rank).start;
                    let (master, m, v) = fsdp.shard_state(u);
                    for spec in self.layout.specs() {
                        let r = spec.range();
                        if r.end <= held.start || r.start >= held.end {
                            continue;
                        }
                        // replicated over tp or ep: the first such rank
                        let first = |axis: weft_parallel::Axis, idx: usize| {
                            idx == 0 || spec.placements.get(axis).is_shard()
                        };
                        if !(first(weft_parallel::Axis::Tp, coords.tp)
                            && first(weft_parallel::Axis::Ep, coords.ep))
                        {
                            continue;
                        }
                        let muon = self.is_muon(&r);
                        for run in spec.first_runs(&sharding)? {
                            let l0 = spec.offset + run.local;
                            let (a, b) = (l0.max(held.start), (l0 + run.len).min(held.end));
                            if a >= b {
                                continue;
                            }
                            let s = a - shard_start..b - shard_start;
                            let v = if muon { &[][..] } else { &v[s.clone()] };
                            f(spec, run.whole + (a - l0), [&master[s.clone()], &m[s], v]);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Loads this stage's part of a checkpoint: `read(which, name, out)`
    /// fills `out` with the whole tensor `name`'s values (`which`: 0 the
    /// parameters, 1 and 2 the AdamW moments), and this stage keeps the
    /// elements its layout holds (a head stage with tied embeddings also
    /// its copy of `wte`); `step` is the optimizer step. Collective over the
    /// data-parallel group when the stage is sharded.
    ///
    /// # Errors
    /// [`Error::Load`] for a tensor `read` cannot give; layout and FSDP
    /// errors.
    pub fn load_with(&mut self, step: u32, read: &mut ReadTensor<'_>) -> Result<()> {
        let sharding = self.layout.coords();
        let mut local: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0.0; self.layout.len()]);
        for (which, buf) in local.iter_mut().enumerate() {
            for spec in self.layout.specs() {
                if which == 2 && self.is_muon(&spec.range()) {
                    continue; // Muon's scratch: not saved
                }
                let mut whole = vec![0.0f32; spec.global_numel()];
                read(which, &spec.name, &mut whole).map_err(|source| Error::Load {
                    tensor: spec.name.clone(),
                    source,
                })?;
                for run in spec.runs(&sharding)? {
                    let l = spec.offset + run.local;
                    buf[l..l + run.len].copy_from_slice(&whole[run.whole..run.whole + run.len]);
                }
            }
        }
        if let Some(copy) = &mut self.tied_copy {
            let wte = self
                .blocks
                .layout()
                .sub(self.blocks.embed_range().start..self.blocks.wte_len());
            for spec in wte.specs() {
                let mut whole = vec![0.0f32; spec.global_numel()];
                read(0, &spec.name, &mut whole).map_err(|source| Error::Load {
                    tensor: spec.name.clone(),
                    source,
                })?;
                for run in spec.runs(&wte.coords())? {
                    let l = spec.offset + run.local;
                    copy[l..l + run.len].copy_from_slice(&whole[run.whole..run.whole + run.len]);
                }
            }
        }
        self.set_state(local, step)
    }

    /// Optimizer steps taken.
    pub fn optimizer_step(&self) -> u32 {
        match &self.store {
            Store::Resident { opt, .. } => opt.step,
            Store::Sharded { fsdp, .. } => fsdp.optimizer_step(),
        }
    }

    /// This stage's resident parameters (empty when sharded).
    pub fn params(&self) -> &[f32] {
        match &self.store {
            Store::Resident { params, .. } => params,
            Store::Sharded { .. } => &[],
        }
    }

    /// This stage's resident parameters, mutably (empty when sharded).
    pub fn params_mut(&mut self) -> &mut [f32] {
        match &mut self.store {
            Store::Resident { params, .. } => params,
            Store::Sharded { .. } => &mut [],
        }
    }

    /// The values of the parameter tensor `name`, if this stage holds it
    /// (its part under tensor or expert parallelism); outside a step.
    /// Collective over the data-parallel group when the stage is sharded.
    ///
    /// # Errors
    /// FSDP's.
    pub fn read_param(&self, name: &str) -> Result<Option<Vec<f32>>> {
        let Some(r) = self.layout.range(name) else {
            return Ok(None);
        };
        Ok(Some(match &self.store {
            Store::Resident { params, .. } => params[r].to_vec(),
            Store::Sharded { fsdp, .. } => fsdp.read_params(r)?,
        }))
    }

    /// Sets the parameter tensor `name` to `values` (the same on every
    /// rank of the data-parallel group) outside a step; `false` if this
    /// stage does not hold it. A tensor the head stage copies (the tied
    /// `wte`) is not refreshed there until the next update.
    ///
    /// # Errors
    /// [`Error::Batch`] for values of another length; FSDP's.
    pub fn write_param(&mut self, name: &str, values: &[f32]) -> Result<bool> {
        let Some(r) = self.layout.range(name) else {
            return Ok(false);
        };
        if r.len() != values.len() {
            return Err(Error::Batch {
                reason: format!("{name}: {} values for {} elements", values.len(), r.len()),
            });
        }
        match &mut self.store {
            Store::Resident { params, .. } => params[r].copy_from_slice(values),
            Store::Sharded { fsdp, .. } => fsdp.write_params(r, values)?,
        }
        Ok(true)
    }

    /// Sets every resident gradient to zero.
    pub fn zero_grad(&mut self) {
        if let Store::Resident { grads, .. } = &mut self.store {
            weft_kernels::zero(grads);
        }
    }

    /// Whether forwards are evaluation: each is followed by
    /// [`discard`](weft_pipeline::Stage::discard), not a backward (a
    /// sharded stage then gathers without keeping gradients).
    pub fn set_eval(&mut self, eval: bool) {
        self.eval = eval;
    }

    /// Starts an optimizer step of `micro_batches` micro-batches on this
    /// rank: resident gradients are zeroed, a sharded stage's FSDP starts
    /// its step.
    ///
    /// # Errors
    /// FSDP's.
    pub fn begin_step(&mut self, micro_batches: usize) -> Result<()> {
        self.eval = false;
        match &mut self.store {
            Store::Resident { grads, .. } => weft_kernels::zero(grads),
            Store::Sharded { fsdp, .. } => fsdp.begin_step(micro_batches)?,
        }
        Ok(())
    }

    /// After the step's last backward: the gradients become the mean over
    /// the `micro_batches` of the global batch — the reducer's exact (or
    /// plain) sum over each tensor's data-parallel group on `mesh`, or
    /// FSDP's reduce-scatters, waited for. Collective over the mesh's
    /// data-parallel groups.
    ///
    /// # Errors
    /// A collective error.
    pub fn finish_backward(
        &mut self,
        mesh: Option<&ParallelMesh>,
        micro_batches: usize,
    ) -> Result<()> {
        match &mut self.store {
            Store::Resident { grads, reducer, .. } => match reducer {
                Some(r) => r.finish(grads, mesh, micro_batches)?,
                None => {
                    #[allow(clippy::cast_precision_loss)]
                    let inv = 1.0 / micro_batches.max(1) as f32;
                    if micro_batches > 1 {
                        grads.iter_mut().for_each(|g| *g *= inv);
                    }
                }
            },
            Store::Sharded { fsdp, .. } => fsdp.finish_backward()?,
        }
        Ok(())
    }

    /// Adds this stage's gradients to the squared norm `norm`, by
    /// placement (a sharded stage: its shards', merged over its group).
    ///
    /// # Errors
    /// FSDP's.
    pub fn add_grad_norm(&mut self, norm: &mut GradNorm) -> Result<()> {
        match &mut self.store {
            Store::Resident { grads, .. } => norm.add_layout(&self.layout, grads),
            Store::Sharded { fsdp, .. } => norm.merge(&fsdp.grad_norm()?),
        }
        Ok(())
    }

    /// Plans Muon for this stage's hidden matrices
    /// ([`muon_matrices`](crate::muon_matrices)) over `group` — the ranks
    /// holding the same stage, every one of them calling this (after
    /// [`shard`](Self::shard), when the stage is sharded) — so that
    /// [`apply`](Self::apply) takes Muon's hyper-parameters. Newton–Schulz
    /// runs in bf16 when the stage's products do, else in f32.
    ///
    /// # Errors
    /// The plan's ([`MuonPlan::new`]).
    pub fn use_muon(&mut self, group: Arc<dyn Communicator>) -> Result<&MuonPlan> {
        let matrices = crate::params::muon_matrices(self.blocks.config(), &self.layout)?;
        let shards = match &self.store {
            Store::Resident { params, .. } => vec![(0..params.len(), 0)],
            Store::Sharded { fsdp, .. } => fsdp.muon_shards(),
        };
        let plan = MuonPlan::new(group, &self.layout, &shards, matrices)?;
        let precision = match self.blocks.precision() {
            Precision::Bf16 => Precision::Bf16,
            _ => Precision::F32,
        };
        Ok(&self.muon.insert((plan, precision)).0)
    }

    /// The Muon plan of [`use_muon`](Self::use_muon), if any.
    pub fn muon(&self) -> Option<&MuonPlan> {
        self.muon.as_ref().map(|(p, _)| p)
    }

    /// Whether the layout range `r` (a tensor's) is Muon's: its second
    /// optimizer buffer is then Muon's scratch, not saved.
    fn is_muon(&self, r: &Range<usize>) -> bool {
        self.muon.as_ref().is_some_and(|(p, _)| p.is_muon(r))
    }

    /// The optimizer step with the gradients times `clip_coef` — over the
    /// resident layout's tensors, or FSDP's shards — by `weft-parallel`'s
    /// one AdamW, and with Muon ([`use_muon`](Self::use_muon)) Muon's
    /// collective step for the hidden matrices.
    ///
    /// # Errors
    /// [`Error::Config`] if `hp` and [`use_muon`](Self::use_muon)
    /// disagree on Muon; a kernel, collective or FSDP error.
    pub fn apply(&mut self, clip_coef: f32, hp: &OptimStep) -> Result<()> {
        let muon = match (&self.muon, &hp.muon) {
            (Some((plan, precision)), Some(m)) => Some((plan, m, *precision)),
            (None, None) => None,
            (planned, _) => {
                return Err(Error::Config {
                    field: "optim.name",
                    reason: if planned.is_some() {
                        "the stage is planned for Muon but the step has no Muon settings".into()
                    } else {
                        "a Muon step on a stage without a Muon plan (GptStage::use_muon)".into()
                    },
                });
            }
        };
        match &mut self.store {
            Store::Resident {
                params, grads, opt, ..
            } => {
                if clip_coef != 1.0 {
                    grads.iter_mut().for_each(|g| *g *= clip_coef);
                }
                match muon {
                    None => opt.step(self.layout.decay_runs(), params, grads, &hp.adamw)?,
                    Some((plan, m, precision)) => {
                        let runs = plan.adamw_runs(self.layout.decay_runs(), 0);
                        let step = opt.step + 1;
                        let (mo, v) = (&mut opt.m, &mut opt.v);
                        weft_parallel::adamw_runs(runs, params, grads, mo, v, &hp.adamw, step)?;
                        plan.momentum(0, grads, mo, v, m)?;
                        plan.orthogonalize(&mut [&mut v[..]], m, precision)?;
                        plan.apply(0, params, v, m)?;
                        opt.step = step;
                    }
                }
            }
            Store::Sharded { fsdp, .. } => {
                let muon = muon.map(|(plan, hp, precision)| weft_fsdp::MuonStep {
                    plan,
                    hp,
                    precision,
                });
                fsdp.apply_with(clip_coef, &hp.adamw, muon)?;
            }
        }
        self.refresh_shared_wte()
    }

    /// Drops the step's gradients without an update.
    pub fn skip(&mut self) {
        match &mut self.store {
            Store::Resident { grads, .. } => weft_kernels::zero(grads),
            Store::Sharded { fsdp, .. } => fsdp.skip(),
        }
    }

    /// Re-plans every slot for micro-batches of `b`×`t` tokens (a
    /// validation set's short last batch); every slot must be free.
    ///
    /// # Errors
    /// [`Error::Batch`] if a micro-batch is in flight or the shape is bad.
    pub fn set_batch_shape(&mut self, b: usize, t: usize) -> Result<()> {
        if (b, t) == (self.b, self.t) {
            return Ok(());
        }
        if self.slots.iter().any(|s| s.state != SlotState::Free) {
            return Err(Error::Batch {
                reason: "cannot re-plan a stage with micro-batches in flight".into(),
            });
        }
        for s in &mut self.slots {
            s.acts = ChunkActs::new(&self.blocks, &self.spec, b, t, self.split)?;
        }
        self.scratch = self.blocks.scratch(b, t)?;
        (self.b, self.t) = (b, t);
        let bytes = self.activation_bytes();
        if let Some(f) = self.fsdp_mut() {
            f.record_activations(bytes);
        }
        Ok(())
    }

    /// (range in the stage's buffer, range in the rank's whole-model
    /// layout) of each contiguous piece this stage holds, in model order.
    pub fn segments(&self) -> &[(Range<usize>, Range<usize>)] {
        &self.segments
    }

    /// This stage's tensors under their Hugging Face names, with offsets
    /// into its buffer (for checkpoints and the optimizer's decay mask).
    pub fn specs(&self) -> &[ParamSpec] {
        self.layout.specs()
    }

    /// This stage's own layout (its tensors, offsets into its buffer).
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

    /// Sets the loss scale of this stage's backwards (see
    /// [`GptBlocks::set_loss_scale`]).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.blocks.set_loss_scale(scale);
    }

    /// Micro-batch shape `(B, T)`.
    pub fn batch_shape(&self) -> (usize, usize) {
        (self.b, self.t)
    }

    /// Floats of one activation or activation-gradient message: the
    /// residual stream of a micro-batch on this rank (`B·T·C`, or its rows
    /// under sequence parallelism).
    pub fn message_len(&self) -> usize {
        self.blocks.residual_len(self.b, self.t)
    }

    /// Whether the stage was planned for the split backward.
    pub fn splits(&self) -> bool {
        self.split
    }

    /// The part of the gradient buffer that the head's backward writes
    /// (`ln_f`, and `lm_head` when untied), at the end of the buffer; `None`
    /// on a stage without the head. With the split backward it is written
    /// by `backward_input`, the rest by `backward_weight` — except on a
    /// single stage with tied embeddings, where the head's part of `wte`
    /// lies in the rest and is completed by `backward_weight`.
    pub fn head_grad_range(&self) -> Option<Range<usize>> {
        self.ranges.lnf.as_ref().map(|l| l.start..self.layout.len())
    }

    /// Bytes of activation storage (all slots plus the shared scratch).
    pub fn activation_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.acts.bytes()).sum::<usize>() + self.scratch.bytes()
    }

    /// Bytes this stage holds, by category (see [`crate::memory`]): the
    /// resident buffers or FSDP's allocations (parameter shards, master
    /// weights and moments, gradients), the planned activations, and the
    /// buffers kept for communication.
    pub fn memory(&self) -> RankMemory {
        use weft_fsdp::Category as C;
        let f = |v: &Vec<f32>| 4 * v.len();
        let tied_copy = self.tied_copy.as_ref().map_or(0, f);
        let exchange =
            f(&self.tied_out) + self.slots.iter().map(|s| f(&s.tied_dwte)).sum::<usize>();
        let mut r = RankMemory {
            activations: self.activation_bytes(),
            ..RankMemory::default()
        };
        match &self.store {
            Store::Resident {
                params,
                grads,
                opt,
                reducer,
            } => {
                r.params = f(params) + tied_copy;
                r.grads = f(grads);
                r.optimizer = f(&opt.m) + f(&opt.v);
                r.comm = exchange + reducer.as_ref().map_or(0, GradReducer::buffer_bytes);
            }
            Store::Sharded { fsdp, wte, .. } => {
                let m = fsdp.memory();
                let cfg = fsdp.config();
                // sharded parameters are gathered from the master weights
                // (in bf16 rounded as they are sent): they are the
                // parameters, the moments the optimizer's
                let master = if cfg.strategy.shards_params() {
                    m.current(C::OptimizerState) / 3
                } else {
                    0
                };
                r.params =
                    m.current(C::ParamShards) + m.current(C::GatheredParams) + master + tied_copy;
                r.grads = m.current(C::Gradients);
                r.optimizer = m.current(C::OptimizerState) - master;
                r.comm = exchange + wte.as_ref().map_or(0, f);
            }
        }
        r
    }

    /// What a stage of `blocks` for `spec`, planned as
    /// [`new`](Self::new) plans it (`slots` micro-batches of `b`×`t`,
    /// `split` backwards) and then either given a gradient reducer
    /// (`fsdp: None`) or [sharded](Self::shard) over `shard` ranks with
    /// `fsdp`, will hold, by category — computed from the sizes alone,
    /// nothing allocated. `experts`: the experts are sharded over an
    /// expert group. `wire_bytes`: bytes per gradient of the reducer's
    /// extra buckets (2 for a bf16 wire, else 0).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::Config`] if a size overflows;
    /// FSDP's errors for its unit plan.
    #[allow(clippy::too_many_arguments)]
    pub fn predict_memory(
        blocks: &GptBlocks,
        spec: &StageSpec,
        b: usize,
        t: usize,
        slots: usize,
        split: bool,
        fsdp: Option<(&weft_fsdp::FsdpConfig, usize)>,
        experts: bool,
        wire_bytes: usize,
    ) -> Result<RankMemory> {
        use crate::blocks::{product, sum};
        let pieces = Pieces::plan(blocks, spec)?;
        let wte = blocks.wte_len();
        let bytes = |what: &str, floats: usize| product(what, &[floats, 4]);
        // activations per slot: the chunk's input and its gradient, the
        // tokens on the embedding chunk, each block's, the head's, and
        // what split backwards keep between B and W
        let nc = blocks.residual_len(b, t);
        let mut per_slot = vec![2 * nc];
        if spec.embed {
            // whole sequences' tokens, on every context-parallel rank
            per_slot.push(product("B·T", &[b, blocks.whole_seq(t)])?);
        }
        let layers = spec.layers.len();
        for l in spec.layers.clone() {
            per_slot.push(blocks.block_acts_len_for(l, b, t)?);
        }
        if chunk::keeps_docs(blocks, spec) {
            per_slot.push(product("B·T", &[b, t])?);
        }
        if spec.head {
            per_slot.push(blocks.head_acts_len(b, t)?);
        }
        if split {
            per_slot.push(product(
                "the blocks' saved gradients",
                &[layers, blocks.weight_inputs_len(b, t)?],
            )?);
        }
        let acts = sum(
            "the activations",
            &[
                product("the activations", &[slots, sum("a slot", &per_slot)?])?,
                blocks.scratch_len(b, t)?,
            ],
        )?;
        let n = pieces.len;
        let tied_copy = if pieces.tied_copy { wte } else { 0 };
        // the exchange: the embedding chunk keeps one wte gradient per slot,
        // the head chunk the latest one
        let exchange = match (pieces.exchange, spec.embed) {
            (false, _) => 0,
            (true, true) => product("the tied exchange", &[slots, wte])?,
            (true, false) => wte,
        };
        let mut r = RankMemory {
            activations: bytes("the activations", acts)?,
            ..RankMemory::default()
        };
        match fsdp {
            None => {
                r.params = bytes("the parameters", sum("the parameters", &[n, tied_copy])?)?;
                r.grads = bytes("the gradients", n)?;
                r.optimizer = bytes("the AdamW moments", product("the AdamW moments", &[2, n])?)?;
                // the reducer's buckets hold every gradient once (and
                // once more in bf16 for a bf16 wire)
                r.comm = sum(
                    "the communication buffers",
                    &[
                        bytes(
                            "the communication buffers",
                            sum("the communication buffers", &[exchange, n])?,
                        )?,
                        product("the bf16 buckets", &[n, wire_bytes])?,
                    ],
                )?;
            }
            Some((cfg, shard)) => {
                let (units, _) = crate::fsdp::units(&pieces.ranges, &pieces.layout, wte, experts);
                let plan = weft_fsdp::UnitPlan::new(&pieces.layout, units, shard)?;
                let bf16 = cfg.precision.param == weft_collectives::Dtype::BF16;
                let (mut shards, mut master) = (0usize, 0usize);
                for u in plan.units() {
                    master += u.shard_len;
                    // sharded: the master weights are the parameters (bf16
                    // ones are rounded as they are gathered); ZeRO-1/2:
                    // the replica, f32 or the bf16 wire's words
                    shards += if cfg.strategy.shards_params() {
                        u.shard_len * 4
                    } else if bf16 {
                        u.bf16_words(shard) * 2
                    } else {
                        u.padded_len(shard) * 4
                    };
                }
                let states = if cfg.strategy.shards_params() { 2 } else { 3 };
                r.params = sum(
                    "the parameters",
                    &[shards, bytes("the tied copy", tied_copy)?],
                )?;
                r.optimizer = bytes(
                    "the optimizer state",
                    product("the optimizer state", &[states, master])?,
                )?;
                // the embedding chunk gathers wte for the head's copy
                let gathered = if pieces.exchange && spec.embed {
                    wte
                } else {
                    0
                };
                r.comm = bytes(
                    "the communication buffers",
                    sum("the communication buffers", &[exchange, gathered])?,
                )?;
            }
        }
        Ok(r)
    }

    /// Whether this stage takes part in the tied-embedding gradient
    /// exchange (tied embeddings, and the embedding and head on different
    /// stages).
    fn tied_exchange(&self) -> bool {
        self.blocks.config().tied_embeddings && self.spec.embed != self.spec.head
    }

    /// The embedding stage's `wte` (the first part of its parameters).
    fn wte(&self) -> Option<&[f32]> {
        let e = self.ranges.embed.as_ref()?;
        match &self.store {
            Store::Resident { params, .. } => params.get(e.start..e.start + self.blocks.wte_len()),
            Store::Sharded { wte, .. } => wte.as_deref(),
        }
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
    /// after its backward (or input half) and until the next one.
    fn tied_wte_grad(&self, mb: usize) -> Option<&[f32]> {
        (self.tied_out_mb == Some(mb)).then_some(self.tied_out.as_slice())
    }

    /// Where the embedding stage stores the head's `wte` gradient of
    /// micro-batch `mb` before its embedding backward. Marks it present.
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

    /// Runs `f` with the stage's store, the slot `i`'s activations and the
    /// shared scratch.
    fn with_store<R>(
        &mut self,
        i: usize,
        f: impl FnOnce(
            &GptBlocks,
            &StageSpec,
            &mut dyn ParamStore,
            &mut Slot,
            &mut BlockScratch,
        ) -> Result<R>,
    ) -> Result<R> {
        let copy = self
            .tied_copy
            .as_deref()
            .map(|c| (c, Some(&mut self.tied_out[..])));
        let slot = &mut self.slots[i];
        match &mut self.store {
            Store::Resident { params, grads, .. } => {
                let mut store = Resident {
                    ranges: &self.ranges,
                    params,
                    grads: Some(grads),
                    copy,
                };
                f(
                    &self.blocks,
                    &self.spec,
                    &mut store,
                    slot,
                    &mut self.scratch,
                )
            }
            Store::Sharded { fsdp, map, ep, .. } => {
                let tp = self.blocks.tp();
                let mb = slot.mb;
                let ep = ep.as_ref().map(|g| (&*g.comm, g.exact));
                let mut store = Sharded {
                    fsdp,
                    map,
                    tp,
                    ep,
                    mb,
                    copy,
                };
                f(
                    &self.blocks,
                    &self.spec,
                    &mut store,
                    slot,
                    &mut self.scratch,
                )
            }
        }
    }

    /// Folds the gradient ranges that `done` finished into the resident
    /// reducer; returns them.
    fn fold(&mut self, done: Vec<Range<usize>>) -> Result<Vec<Range<usize>>> {
        match &mut self.store {
            Store::Resident {
                grads,
                reducer: Some(r),
                ..
            } => {
                for range in &done {
                    r.add(range.clone(), grads)?;
                }
                Ok(done)
            }
            Store::Resident { .. } => Ok(done),
            // FSDP reduces its own units in their post_backward hooks
            Store::Sharded { .. } => Ok(Vec::new()),
        }
    }

    fn begin_backward(&mut self, i: usize) {
        if self.tied_copy.is_some() {
            weft_kernels::zero(&mut self.tied_out);
            self.tied_out_mb = Some(self.slots[i].mb);
        }
    }

    fn check_tied_ready(&self, i: usize) -> Result<()> {
        let slot = &self.slots[i];
        if self.tied_exchange() && self.spec.embed && !slot.tied_ready {
            return Err(Error::Batch {
                reason: format!(
                    "embedding backward of micro-batch {} before the head's wte gradient arrived (tied embeddings)",
                    slot.mb
                ),
            });
        }
        Ok(())
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
        self.split
    }

    fn forward(
        &mut self,
        mb: usize,
        batch: &MicroBatch<'_>,
        input: Option<&[f32]>,
        output: Option<&mut [f32]>,
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
        let inp = match input {
            None => ChunkInput::Tokens(batch.tokens),
            Some(x) => ChunkInput::Hidden(x),
        };
        let targets = self.spec.head.then_some(batch.targets);
        if let Store::Sharded { fsdp, .. } = &mut self.store
            && self.eval
        {
            fsdp.begin_eval()?;
        }
        let loss = self.with_store(free, |bl, spec, store, slot, scratch| {
            chunk::forward(
                bl,
                spec,
                store,
                &mut slot.acts,
                scratch,
                inp,
                batch.tokens,
                targets,
            )
        })?;
        let slot = &mut self.slots[free];
        slot.mb = mb;
        slot.state = SlotState::Forwarded;
        slot.tied_ready = false;
        if let Some(out) = output {
            let y = slot.acts.output();
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
        let i = self.slot_of(mb, SlotState::Forwarded, "backward")?;
        self.check_tied_ready(i)?;
        self.begin_backward(i);
        self.with_store(i, |bl, spec, store, slot, scratch| {
            let extra = (!slot.tied_dwte.is_empty()).then_some(slot.tied_dwte.as_slice());
            chunk::backward(bl, spec, store, &mut slot.acts, scratch, dout, extra)
        })?;
        if !self.spec.embed {
            copy_out(dinput, &self.slots[i].acts.dres)?;
        }
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        slot.tied_ready = false;
        let all = std::iter::once(0..self.layout.len()).collect();
        self.fold(all)
    }

    fn backward_input(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>> {
        let i = self.slot_of(mb, SlotState::Forwarded, "backward-for-input")?;
        if !self.split {
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
        self.begin_backward(i);
        self.with_store(i, |bl, spec, store, slot, scratch| {
            chunk::backward_input(bl, spec, store, &mut slot.acts, scratch, dout)
        })?;
        self.slots[i].state = SlotState::InputDone;
        if !self.spec.embed {
            copy_out(dinput, &self.slots[i].acts.dres)?;
        }
        let done = self.head_grad_range().into_iter().collect();
        self.fold(done)
    }

    fn backward_weight(&mut self, mb: usize) -> Result<Vec<Range<usize>>> {
        let i = self.slot_of(mb, SlotState::InputDone, "backward-for-weights")?;
        self.check_tied_ready(i)?;
        self.with_store(i, |bl, spec, store, slot, scratch| {
            let extra = (!slot.tied_dwte.is_empty()).then_some(slot.tied_dwte.as_slice());
            chunk::backward_weight(bl, spec, store, &mut slot.acts, scratch, extra)
        })?;
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        slot.tied_ready = false;
        let end = self
            .head_grad_range()
            .map_or(self.layout.len(), |r| r.start);
        self.fold(std::iter::once(0..end).collect())
    }

    fn discard(&mut self, mb: usize) -> Result<()> {
        let i = self.slot_of(mb, SlotState::Forwarded, "discard")?;
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        slot.tied_ready = false;
        if let Store::Sharded { fsdp, .. } = &mut self.store {
            fsdp.end_eval()?;
        }
        Ok(())
    }

    fn grads(&self) -> &[f32] {
        match &self.store {
            Store::Resident { grads, .. } => grads,
            Store::Sharded { .. } => &[],
        }
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        match &mut self.store {
            Store::Resident { grads, .. } => grads,
            Store::Sharded { .. } => &mut [],
        }
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
            .then_some(self.tied_copy.as_deref_mut())
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
