//! Incremental decoding with a key/value cache: the inference engine.
//!
//! A [`Decoder`] borrows a [`Gpt`] and keeps, for every layer, the key and
//! value vectors of the positions fed so far (`(block_size, 2·Ckv)` floats
//! per layer, a sliding-window layer only its window's `(W, 2·Ckv)` as a
//! ring; allocated up front with every working buffer; [`Decoder::bytes`]
//! reports the total). [`Decoder::prefill`] runs a prompt through the model in one
//! pass — its linear layers as GEMMs over the prompt's rows — and
//! [`Decoder::step`] then appends one token at a time, each computing only
//! the new position: its projections, and its attention over the cached
//! keys and values.
//!
//! # Same bits as training
//!
//! The logits a decoder returns for a position are **bitwise equal** to
//! the training forward's ([`Gpt::forward`], [`Activations::logits`]) for
//! the same prefix, so text sampled from a model is sampled from exactly
//! the distribution training sees (anything trained on sampled tokens, as
//! in reinforcement learning, is then on-policy to the bit). This holds
//! because every kernel on the path is row-invariant: layernorm, GELU,
//! residual adds and embeddings work row by row, the linear layers give a
//! row the same bits whatever rows are computed with it (see
//! `weft_kernels`' matmul docs), and [`weft_kernels::attention_decode`]
//! reproduces one row of [`weft_kernels::attention_forward`], summing over
//! keys in the same order. The feed-forward block must compute each token
//! on its own: GPT-2's [`Mlp`](crate::Mlp), or a [`MoeFfn`](crate::MoeFfn)
//! with a dropless token-choice router (a capacity limit or expert choice
//! makes a token's output depend on other tokens, which a decoder cannot
//! see). `tests/infer.rs` checks the equality for dense and MoE models,
//! every prompt length and greedy continuations to the full block, and
//! under document masking ([`GptBlocks::set_doc_boundary`]), where the
//! decoder tracks the document each position belongs to from the boundary
//! tokens it has been fed, as the training forward does from its batch.
//!
//! [`GptBlocks::set_doc_boundary`]: crate::GptBlocks::set_doc_boundary
//!
//! [`Activations::logits`]: crate::Activations::logits
//!
//! # Example
//!
//! ```
//! use weft_model::{Decoder, Gpt, GptConfig};
//!
//! let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, block_size: 8,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5, arch: weft_model::BlockArch::GPT2 };
//! let mut model = Gpt::new(cfg)?;
//! model.init_gpt2(7);
//! let mut dec = Decoder::new(&model);
//! assert!(dec.bytes() > 0);
//! // Greedy decoding: prefill a prompt, then feed back the argmax.
//! let mut tokens = vec![3u32, 14, 15];
//! let mut next = argmax(dec.prefill(&tokens)?);
//! while dec.len() < dec.capacity() {
//!     tokens.push(next);
//!     next = argmax(dec.step(next)?);
//! }
//! assert_eq!(tokens.len(), 8);
//!
//! // The last logits are the training forward's for the same prefix, bit for bit.
//! let mut acts = model.activations(1, 8)?;
//! model.forward(&mut acts, &tokens, None)?;
//! let full = &acts.logits()[7 * 50..];
//! assert!(dec.logits().iter().zip(full).all(|(a, b)| a.to_bits() == b.to_bits()));
//!
//! fn argmax(logits: &[f32]) -> u32 {
//!     let mut best = 0;
//!     for (i, &x) in logits.iter().enumerate() {
//!         if x > logits[best] { best = i; }
//!     }
//!     best as u32
//! }
//! # Ok::<(), weft_model::Error>(())
//! ```

use weft_kernels::{
    Heads, LinearInput, attention_decode, encoder_forward, matmul_forward, matmul_forward_wt,
    residual_forward, rope_forward,
};

use crate::blocks::bias;
use crate::config::GptConfig;
use crate::error::{Error, Result};
use crate::ffn::Dims;
use crate::gpt::Gpt;

/// Incremental decoding over a [`Gpt`] with a key/value cache (see the
/// module docs).
#[derive(Debug)]
pub struct Decoder<'m> {
    model: &'m Gpt,
    /// Positions held in the cache.
    len: usize,
    /// Where the document of the next position starts (document masking:
    /// one past the last boundary token fed; else 0).
    doc: usize,
    pos: Vec<u32>,       // (maxT) positions (within their documents) of the fed tokens
    kv: Vec<f32>,        // per layer (its capacity, 2·Ckv): rows [k | v], a ring when windowed
    kv_at: Vec<usize>,   // (L+1) each layer's first float in `kv`
    win: Vec<f32>,       // (W+63, 2·Ckv) a windowed layer's keys in position order
    x: Vec<f32>,         // (maxT, C) residual stream
    res2: Vec<f32>,      // (maxT, C) residual after attention
    ln: Vec<f32>,        // (maxT, C)
    mean: Vec<f32>,      // (maxT)
    rstd: Vec<f32>,      // (maxT)
    qkv: Vec<f32>,       // (maxT, Cq+2·Ckv)
    qk_raw: Vec<f32>,    // QK-norm's input (maxT·(NH+NKV), HS), with it
    qk_rstd: Vec<f32>,   // (maxT·(NH+NKV)), with QK-norm
    atty: Vec<f32>,      // (maxT, Cq)
    tmp: Vec<f32>,       // (maxT, C)
    ffn_saved: Vec<f32>, // the feed-forward block's saved_len for maxT
    ffn_scratch: Vec<f32>, // and its scratch_len
    logits: Vec<f32>,    // (V)
}

impl<'m> Decoder<'m> {
    /// An empty cache for `model`, with room for `block_size` positions.
    /// Allocates everything it will use.
    pub fn new(model: &'m Gpt) -> Self {
        let cfg = model.config();
        let GptConfig {
            n_layer: l,
            n_embd: c,
            vocab_size: v,
            block_size: t,
            ..
        } = *cfg;
        let (cq, ckv) = (cfg.q_dim(), cfg.kv_dim());
        let qk = if cfg.arch.qk_norm { t * (cq + ckv) } else { 0 };
        let z = |k: usize| vec![0.0f32; k];
        // a windowed layer keeps only its window's positions
        let kv_at: Vec<usize> = std::iter::once(0)
            .chain((0..l).scan(0, |at, layer| {
                *at += cfg.window(layer).map_or(t, |w| w.min(t)) * 2 * ckv;
                Some(*at)
            }))
            .collect();
        // (and the positions before it back to its first key's leaf of 64)
        let widest = (0..l)
            .filter_map(|layer| cfg.window(layer))
            .map(|w| (w + 63).min(t))
            .max()
            .unwrap_or(0);
        Decoder {
            model,
            len: 0,
            doc: 0,
            pos: vec![0; t],
            kv: z(kv_at[l]),
            kv_at,
            win: z(widest * 2 * ckv),
            x: z(t * c),
            res2: z(t * c),
            ln: z(t * c),
            mean: z(t),
            rstd: z(t),
            qkv: z(t * (cq + 2 * ckv)),
            qk_raw: z(qk),
            qk_rstd: z(qk / cfg.head_dim().max(1)),
            atty: z(t * cq),
            tmp: z(t * c),
            ffn_saved: z(model.blocks().ffn().saved_len(&Dims {
                b: 1,
                t,
                c,
                mode: model.blocks().mode(),
                precision: model.blocks().precision(),
                loss_scale: 1.0,
                layer: 0,
                tp: None,
                replay: false,
                selective: false,
            })),
            ffn_scratch: z(model.blocks().ffn().scratch_len(&Dims {
                b: 1,
                t,
                c,
                mode: model.blocks().mode(),
                precision: model.blocks().precision(),
                loss_scale: 1.0,
                layer: 0,
                tp: None,
                replay: false,
                selective: false,
            })),
            logits: z(v),
        }
    }

    /// Positions in the cache (prompt plus generated tokens fed so far).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache holds at most: the model's `block_size`.
    pub fn capacity(&self) -> usize {
        self.model.config().block_size
    }

    /// Bytes of the key/value cache alone: `block_size · 2·Ckv` floats per
    /// layer, `W · 2·Ckv` for a layer with a sliding window of `W`.
    pub fn kv_bytes(&self) -> usize {
        self.kv.len() * 4
    }

    /// Bytes of everything the decoder allocated: the key/value cache and
    /// the working buffers (sized for a prompt of `block_size` tokens).
    pub fn bytes(&self) -> usize {
        [
            &self.kv,
            &self.win,
            &self.x,
            &self.res2,
            &self.ln,
            &self.mean,
            &self.rstd,
            &self.qkv,
            &self.atty,
            &self.tmp,
            &self.ffn_saved,
            &self.logits,
        ]
        .iter()
        .map(|b| b.len() * 4)
        .sum::<usize>()
            + self.pos.len() * 4
    }

    /// Empties the cache (keeping its memory) to start a new sequence.
    pub fn reset(&mut self) {
        self.len = 0;
        self.doc = 0;
    }

    /// The logits `(V)` of the last position fed.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Feeds a prompt (appended after whatever the cache holds) in one pass
    /// and returns the logits `(V)` of its last position.
    ///
    /// # Errors
    /// [`Error::Batch`] if `tokens` is empty or the cache cannot hold them
    /// (more than `block_size` positions in all); a kernel error
    /// ([`weft_kernels::Error::TokenOutOfRange`]) for an id outside the
    /// vocabulary. After an error the cache is unchanged.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.feed(tokens)?;
        Ok(&self.logits)
    }

    /// Feeds one token and returns the logits `(V)` of its position.
    ///
    /// # Errors
    /// As [`prefill`](Self::prefill).
    pub fn step(&mut self, token: u32) -> Result<&[f32]> {
        self.feed(&[token])?;
        Ok(&self.logits)
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<()> {
        let model = self.model;
        let cfg = model.config();
        let GptConfig {
            n_head: nh,
            n_embd: c,
            vocab_size: v,
            block_size: max_t,
            ..
        } = *cfg;
        let (cq, ckv) = (cfg.q_dim(), cfg.kv_dim());
        let cols = cq + 2 * ckv;
        let heads = Heads {
            q: nh,
            kv: cfg.n_kv_head(),
        };
        let (start, n) = (self.len, tokens.len());
        if n == 0 || start + n > max_t {
            return Err(Error::Batch {
                reason: format!(
                    "cannot feed {n} token(s) after {start}: need 1 or more, and at most \
                     block_size = {max_t} positions in all"
                ),
            });
        }
        let p = &model.params;
        let bl = model.blocks();
        let (mode, precision) = (bl.mode(), bl.precision());
        let nc = n * c;
        // Each new position's document start (document masking: one past
        // the last boundary token before it) and position within it.
        let mut doc = self.doc;
        let mut starts = Vec::with_capacity(n);
        for (i, (&tok, pos)) in tokens.iter().zip(&mut self.pos[..n]).enumerate() {
            starts.push(doc);
            // `start + i < maxT`, which fits the position table's `u32`s.
            *pos = (start + i - doc) as u32;
            if Some(tok) == bl.doc_boundary() {
                doc = start + i + 1;
            }
        }
        let (wte, wpe) = p[bl.embed_range()].split_at(bl.wte_len());
        if wpe.is_empty() {
            // rotary positions: the token embedding alone
            bl.embed_forward(&mut self.x[..nc], tokens, &p[bl.embed_range()], 1, n)?;
        } else {
            encoder_forward(
                &mut self.x[..nc],
                tokens,
                Some(&self.pos[..n]),
                wte,
                wpe,
                1,
                n,
                c,
            )?;
        }
        let ffn = model.blocks().ffn();
        let dims = |layer| Dims {
            b: 1,
            t: n,
            c,
            mode,
            precision,
            loss_scale: 1.0,
            layer,
            tp: None,
            replay: false,
            selective: false,
        };
        let saved = ffn.saved_len(&dims(0));
        let layer = bl.block_layout();
        for l in 0..model.config().n_layer {
            let p = &p[bl.block_range(l)];
            let ln = &mut self.ln[..nc];
            bl.norm_forward(
                ln,
                &mut self.mean[..n],
                &mut self.rstd[..n],
                &self.x[..nc],
                &p[layer.ln1_w.clone()],
                &p[layer.ln1_b.clone()],
                n,
            )?;
            let qkv = &mut self.qkv[..n * cols];
            matmul_forward(
                qkv,
                ln,
                &p[layer.qkv_w.clone()],
                bias(p, &layer.qkv_b),
                1,
                n,
                c,
                cols,
                mode,
                precision,
            )?;
            if cfg.arch.qk_norm {
                let qk = n * (cq + ckv);
                bl.qk_norm_forward(
                    qkv,
                    &mut self.qk_raw[..qk],
                    &mut self.qk_rstd[..qk / cfg.head_dim()],
                    &p[layer.qk_norm.clone()],
                    n,
                )?;
            }
            if let Some(table) = bl.rope_table() {
                rope_forward(qkv, table, &self.pos[..n], n, cols, nh + heads.kv)?;
            }
            let kv = &mut self.kv[self.kv_at[l]..self.kv_at[l + 1]];
            let window = cfg.window(l);
            // the ring's slots: a windowed layer keeps its last `cap`
            // positions (a row is written just before it attends, so the
            // ring then holds every key it sees)
            let cap = kv.len() / (2 * ckv).max(1);
            let row_of = |pos: usize| (pos % cap.max(1)) * 2 * ckv;
            if window.is_none() {
                for (i, row) in qkv.chunks_exact(cols).enumerate() {
                    let at = row_of(start + i);
                    kv[at..at + 2 * ckv].copy_from_slice(&row[cq..]);
                }
            }
            for (i, row) in qkv.chunks_exact(cols).enumerate() {
                let pos = start + i;
                let out = &mut self.atty[i * cq..(i + 1) * cq];
                let Some(w) = window else {
                    attention_decode(
                        out,
                        &row[..cq],
                        &kv[..(pos + 1) * 2 * ckv],
                        pos,
                        starts[i],
                        cq,
                        heads,
                    )?;
                    continue;
                };
                let at = row_of(pos);
                kv[at..at + 2 * ckv].copy_from_slice(&row[cq..]);
                // the keys it sees, in position order from the start of
                // the first one's leaf of 64 keys: the same leaves and sums
                // as over the whole cache (the keys before `first` weigh
                // 0; zeros stand for those the ring no longer holds)
                let first = starts[i].max((pos + 1).saturating_sub(w));
                let leaf = first - first % 64;
                let m = pos + 1 - leaf;
                self.win[..(first - leaf) * 2 * ckv].fill(0.0);
                for p in first..=pos {
                    let (src, j) = (row_of(p), p - leaf);
                    self.win[j * 2 * ckv..(j + 1) * 2 * ckv]
                        .copy_from_slice(&kv[src..src + 2 * ckv]);
                }
                attention_decode(
                    out,
                    &row[..cq],
                    &self.win[..m * 2 * ckv],
                    m - 1,
                    first - leaf,
                    cq,
                    heads,
                )?;
            }
            matmul_forward(
                &mut self.tmp[..nc],
                &self.atty[..n * cq],
                &p[layer.proj_w.clone()],
                bias(p, &layer.proj_b),
                1,
                n,
                cq,
                c,
                mode,
                precision,
            )?;
            residual_forward(&mut self.res2[..nc], &self.x[..nc], &self.tmp[..nc], nc)?;
            bl.norm_forward(
                &mut self.ln[..nc],
                &mut self.mean[..n],
                &mut self.rstd[..n],
                &self.res2[..nc],
                &p[layer.ln2_w.clone()],
                &p[layer.ln2_b.clone()],
                n,
            )?;
            ffn.forward(
                &mut self.tmp[..nc],
                &mut self.ffn_saved[..saved],
                &mut self.ffn_scratch,
                LinearInput::Wide(&self.ln[..nc]),
                &p[layer.ffn.start..],
                dims(l),
            )?;
            residual_forward(&mut self.x[..nc], &self.res2[..nc], &self.tmp[..nc], nc)?;
        }
        // Only the last position's logits are wanted: its own rows suffice.
        let (lnf_w, lnf_b) = p[bl.lnf_range()].split_at(c);
        bl.norm_forward(
            &mut self.ln[..c],
            &mut self.mean[..1],
            &mut self.rstd[..1],
            &self.x[nc - c..nc],
            lnf_w,
            lnf_b,
            1,
        )?;
        matmul_forward_wt(
            &mut self.logits,
            &self.ln[..c],
            &p[bl.lm_head_range()],
            None,
            1,
            1,
            c,
            v,
            mode,
            precision,
        )?;
        self.len = start + n;
        self.doc = doc;
        Ok(())
    }
}

/// How the next token is chosen from a position's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token (greedy, the
    /// lowest id on ties).
    pub temperature: f64,
    /// Draw only among the `top_k` most likely tokens (0: all).
    pub top_k: usize,
}

impl Sampling {
    /// The most likely token, always.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
    };

    /// The next token: the argmax of `logits` (lowest id on ties) at
    /// temperature 0, else the draw `u` (uniform in `[0, 1)`) from
    /// `softmax(logits / T)` over the `top_k` most likely tokens (ties by
    /// id, so a draw is deterministic).
    #[must_use]
    pub fn pick(&self, logits: &[f32], u: f64) -> u32 {
        let id = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
        if self.temperature == 0.0 {
            let mut best = 0;
            for (i, &x) in logits.iter().enumerate() {
                if x > logits[best] {
                    best = i;
                }
            }
            return id(best);
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        if self.top_k > 0 && self.top_k < logits.len() {
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            order.truncate(self.top_k);
        }
        let max = order
            .iter()
            .map(|&i| f64::from(logits[i]))
            .fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| ((f64::from(logits[i]) - max) / self.temperature).exp())
            .collect();
        let mut u = u * weights.iter().sum::<f64>();
        for (&i, &w) in order.iter().zip(&weights) {
            if u < w {
                return id(i);
            }
            u -= w;
        }
        id(order[order.len() - 1])
    }
}

impl Decoder<'_> {
    /// Continues `prompt` by `n` tokens chosen by `sampling`, each draw
    /// from `uniform` (values in `[0, 1)`), and returns them (the prompt
    /// not repeated). When the cache is full the context slides: the
    /// newest half of the block is prefilled again and decoding goes on.
    /// `after_forward` runs after every forward (to drain a mixture of
    /// experts' load log, say). Starts from an empty cache.
    ///
    /// # Errors
    /// As [`prefill`](Self::prefill) and [`step`](Self::step): an empty
    /// prompt, one longer than the block, an id outside the vocabulary.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        n: usize,
        sampling: Sampling,
        uniform: &mut dyn FnMut() -> f64,
        after_forward: &mut dyn FnMut(),
    ) -> Result<Vec<u32>> {
        let block = self.capacity();
        self.reset();
        let mut context: Vec<u32> = prompt.to_vec();
        // `n` comes from the user: grow as tokens come, not from it
        let mut out = Vec::with_capacity(n.min(block));
        let mut logits = self.prefill(&context)?.to_vec();
        after_forward();
        for i in 0..n {
            let next = sampling.pick(&logits, uniform());
            out.push(next);
            if i + 1 == n {
                break;
            }
            context.push(next);
            if self.len() == block {
                let keep = (block / 2).max(1);
                context.drain(..context.len() - keep);
                self.reset();
                logits = self.prefill(&context)?.to_vec();
            } else {
                logits = self.step(next)?.to_vec();
            }
            after_forward();
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform draws in `[0, 1)` (splitmix64).
    fn uniforms(mut state: u64) -> impl FnMut() -> f64 {
        move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            #[allow(clippy::cast_precision_loss)]
            let u = ((z ^ (z >> 31)) >> 11) as f64 * (-53f64).exp2();
            u
        }
    }

    #[test]
    fn greedy_picks_the_first_maximum_and_top_k_one_is_greedy() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.9];
        assert_eq!(Sampling::GREEDY.pick(&logits, 0.7), 1);
        let top1 = Sampling {
            temperature: 5.0,
            top_k: 1,
        };
        let mut u = uniforms(0);
        for _ in 0..20 {
            assert_eq!(top1.pick(&logits, u()), 1);
        }
    }

    /// Draws follow softmax(logits / T) restricted to the top k
    /// (frequencies within 5 standard errors).
    #[test]
    fn draws_follow_the_tempered_softmax_of_the_top_k() {
        let logits = [1.0f32, 0.0, 2.0, -3.0];
        let s = Sampling {
            temperature: 2.0,
            top_k: 3,
        };
        let w: Vec<f64> = [1.0f64, 0.0, 2.0].iter().map(|x| (x / 2.0).exp()).collect();
        let total: f64 = w.iter().sum();
        let want = [w[0] / total, w[1] / total, w[2] / total, 0.0];
        let mut u = uniforms(9);
        let n: u32 = 40_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.pick(&logits, u()) as usize] += 1;
        }
        for (i, (&c, &p)) in counts.iter().zip(&want).enumerate() {
            #[allow(clippy::cast_precision_loss)]
            let f = c as f64 / f64::from(n);
            let se = (p * (1.0 - p) / f64::from(n)).sqrt().max(1e-9);
            assert!((f - p).abs() <= 5.0 * se, "token {i}: {f} vs {p}");
        }
    }
}
