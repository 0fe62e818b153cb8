//! Batches for training and evaluation from any [`Source`]: the synthetic
//! corpus, text tokenized when the run starts, or prepared token data (one
//! corpus or a blend).
//!
//! Every source hands out batches by *position*, not by iterator state:
//! the training batch of optimizer step `s`, micro-batch `k` is a pure
//! function of `(seed, s, k)` — for prepared data, of the sample number
//! `s · global_batch + position in the batch`, so it does not depend on
//! how the batch is cut over ranks or micro-batches. A resumed run
//! therefore sees exactly the batches an uninterrupted one would, with
//! nothing to save but the step.

use std::path::PathBuf;

use rand_core::SeedableRng;
use rand_pcg::Pcg64;

use crate::corpus::Corpus;
use crate::error::{DataError, Result};
use crate::loader::{Loader, Share};
use crate::spec::{DataSpec, Source, TokenIds};
use crate::synthetic::{Sequence, SyntheticLanguage};
use crate::text::TextData;

/// Token sequences for one micro-batch: `inputs[b·T + t]` is followed by
/// `targets[b·T + t]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// (B, T) input token ids.
    pub inputs: Vec<u32>,
    /// (B, T) next-token targets.
    pub targets: Vec<u32>,
    /// B.
    pub batch: usize,
    /// T.
    pub seq: usize,
}

impl Batch {
    pub(crate) fn from_windows(windows: &[Vec<u32>], seq: usize) -> Self {
        let mut inputs = Vec::with_capacity(windows.len() * seq);
        let mut targets = Vec::with_capacity(windows.len() * seq);
        for w in windows {
            inputs.extend_from_slice(&w[..seq]);
            targets.extend_from_slice(&w[1..=seq]);
        }
        Self {
            inputs,
            targets,
            batch: windows.len(),
            seq,
        }
    }
}

/// How a [`Dataset`] cuts its sequences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DatasetOptions {
    /// Tokens per training sequence, T (a window holds T + 1).
    pub seq: usize,
    /// Seed of the sampling order (`train.seed`).
    pub seed: u64,
    /// Sequences per optimizer step (`train.batch_size`): prepared data
    /// numbers its samples `step · global_batch + position`.
    pub global_batch: usize,
}

/// Where batches come from.
#[derive(Debug)]
pub enum Dataset {
    /// The synthetic language.
    Synthetic(SyntheticData),
    /// Tokenized text.
    Text(TextData),
    /// Prepared token data, or a blend of several.
    Tokens(TokenData),
}

impl Dataset {
    /// Opens the data `spec` names, cut as `opts` says: the synthetic
    /// language built, text read and tokenized (or its token cache
    /// mapped), token data memory-mapped.
    ///
    /// # Errors
    /// [`DataError`] for unreadable, empty or too-short data, or invalid
    /// synthetic settings, naming the file.
    pub fn open(spec: &DataSpec, opts: &DatasetOptions) -> Result<Self> {
        match &spec.source {
            Source::Synthetic => Ok(Dataset::Synthetic(SyntheticData {
                lang: SyntheticLanguage::new(spec.synthetic.clone())?,
                seq: opts.seq,
                seed: opts.seed,
            })),
            Source::Text(path) => {
                let tok = match spec.named_tokenizer()? {
                    Some(t) => t,
                    None => crate::tokenizer::Tokenizer::gpt2()?,
                };
                TextData::open(path, &tok, opts.seq, spec.val_fraction, opts.seed)
                    .map(Dataset::Text)
            }
            Source::Tokens(_) | Source::Blend(_) => {
                let (corpora, ids) = open_corpora(&spec.parts(), spec)?;
                Ok(Dataset::Tokens(TokenData {
                    loader: Loader::new(corpora, opts.seq, opts.seed)?,
                    global_batch: opts.global_batch as u64,
                    ids,
                }))
            }
        }
    }

    /// Size of the token id space: the model's vocabulary size.
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        match self {
            Dataset::Synthetic(s) => s.lang.vocab_size(),
            Dataset::Text(t) => t.vocab_size(),
            Dataset::Tokens(t) => t.ids.vocab_size,
        }
    }

    /// The token between documents (none for the synthetic corpus).
    #[must_use]
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            Dataset::Synthetic(_) => None,
            Dataset::Text(t) => Some(t.end_of_text()),
            Dataset::Tokens(t) => t.ids.end_of_text,
        }
    }

    /// The training micro-batch of `batch` sequences for optimizer step
    /// `step`, micro-batch `micro`.
    ///
    /// # Errors
    /// Prepared data only: a damaged shard or an id outside the
    /// vocabulary, naming the file (never trained on).
    pub fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Result<Batch> {
        Ok(match self {
            Dataset::Synthetic(s) => s.train_batch(step, micro, batch),
            Dataset::Text(t) => t.train_batch(step, micro, batch),
            Dataset::Tokens(t) => t.train_batch(step, micro, batch)?,
        })
    }

    /// The first `n` validation sequences (fewer if the validation split
    /// holds fewer), in batches of at most `batch`.
    ///
    /// # Errors
    /// As [`train_batch`](Self::train_batch).
    pub fn val_batches(&self, n: usize, batch: usize) -> Result<Vec<Batch>> {
        Ok(match self {
            Dataset::Synthetic(s) => s.val_batches(n, batch),
            Dataset::Text(t) => t.val_batches(n, batch),
            Dataset::Tokens(t) => t.val_batches(n, batch)?,
        })
    }

    /// For prepared data, what each dataset gives over the first
    /// `samples` samples (one entry for a single dataset).
    #[must_use]
    pub fn shares(&self, samples: u64) -> Vec<Share> {
        match self {
            Dataset::Tokens(t) => t.loader.shares(samples),
            _ => Vec::new(),
        }
    }

    /// The best achievable mean loss (nats per token) on
    /// [`val_batches`](Self::val_batches)`(n, _)`, when known.
    #[must_use]
    pub fn val_floor(&self, n: usize) -> Option<f64> {
        match self {
            Dataset::Synthetic(s) => Some(s.val_floor(n)),
            Dataset::Text(_) | Dataset::Tokens(_) => None,
        }
    }
}

/// Opens each token dataset of `parts` (path, weight), memory-mapped,
/// for the spec's tokenizer (when it names one) with its `val_fraction`
/// held out by document, and checks that they hold ids of one tokenizer:
/// the same vocabulary size, the same recorded tokenizer where two
/// record one, and under `doc_mask` the same end-of-text token.
pub(crate) fn open_corpora(
    parts: &[(PathBuf, f64)],
    spec: &DataSpec,
) -> Result<(Vec<(Corpus, f64)>, TokenIds)> {
    let tok = spec.named_tokenizer()?;
    let mut out: Vec<(Corpus, f64)> = Vec::with_capacity(parts.len());
    for (p, w) in parts {
        let c = Corpus::open_for(p, spec.val_fraction, tok.as_ref())?;
        let Some(vocab) = c.vocab_size else {
            return Err(DataError::Tokenizer {
                path: p.clone(),
                what: "int32 ids of an unknown tokenizer: name the tokenizer.json they were made with in data.tokenizer, so the vocabulary size is known".into(),
            });
        };
        if let Some((first, _)) = out.first() {
            let f = first.path.display();
            let what = if first.vocab_size != Some(vocab) {
                Some(format!(
                    "ids of a vocabulary of {vocab}, and {f} of {}",
                    first.vocab_size.unwrap_or(0)
                ))
            } else if let (Some(a), Some(b)) = (&first.tokenizer, &c.tokenizer)
                && a != b
            {
                Some(format!("ids of tokenizer {b}, and {f} of tokenizer {a}"))
            } else if spec.doc_mask && first.end_of_text != c.end_of_text {
                Some(format!(
                    "end-of-text {:?}, and {f} {:?} (data.doc_mask)",
                    c.end_of_text, first.end_of_text
                ))
            } else {
                None
            };
            if let Some(what) = what {
                return Err(DataError::TokenizerMismatch {
                    path: p.clone(),
                    what: format!("{what}: a blend trains the ids of one tokenizer"),
                });
            }
        }
        out.push((c, *w));
    }
    let first = &out
        .first()
        .ok_or_else(|| DataError::Blend("no datasets".into()))?
        .0;
    let ids = TokenIds {
        vocab_size: first.vocab_size.unwrap_or(0),
        end_of_text: first.end_of_text,
    };
    Ok((out, ids))
}

/// Prepared token data: one corpus, or a blend.
#[derive(Debug)]
pub struct TokenData {
    /// The sequences.
    pub loader: Loader,
    /// Sequences per optimizer step.
    global_batch: u64,
    /// The id space and the end-of-text token of every corpus.
    ids: TokenIds,
}

impl TokenData {
    fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Result<Batch> {
        let seq = self.loader.seq();
        let mut windows = Vec::with_capacity(batch);
        for b in 0..batch {
            let g = step * self.global_batch + (micro * batch + b) as u64;
            let mut w = Vec::with_capacity(seq + 1);
            self.loader.train_sequence(g, &mut w)?;
            windows.push(w);
        }
        Ok(Batch::from_windows(&windows, seq))
    }

    fn val_batches(&self, n: usize, batch: usize) -> Result<Vec<Batch>> {
        let all = self.loader.val_sequences(n)?;
        Ok(all
            .chunks(batch.max(1))
            .map(|w| Batch::from_windows(w, self.loader.seq()))
            .collect())
    }
}

/// Mixes a seed, a stream name and indices into an RNG seed (SplitMix64).
pub(crate) fn stream(seed: u64, name: u64, a: u64, b: u64) -> Pcg64 {
    let mut z = seed;
    for v in [name, a, b] {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(v);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    Pcg64::seed_from_u64(z)
}

/// The stream of training windows.
pub(crate) const TRAIN: u64 = 1;
/// The stream of validation windows.
pub(crate) const VAL: u64 = 2;

/// Batches from the synthetic language: every sequence is a fresh sample.
#[derive(Debug)]
pub struct SyntheticData {
    /// The language.
    pub lang: SyntheticLanguage,
    seq: usize,
    seed: u64,
}

impl SyntheticData {
    fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Batch {
        let windows: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                let mut rng = stream(self.seed, TRAIN, step, (micro * batch + b) as u64);
                self.lang.sample(self.seq + 1, &mut rng).tokens
            })
            .collect();
        Batch::from_windows(&windows, self.seq)
    }

    fn val_sequence(&self, i: usize) -> Sequence {
        self.lang
            .sample(self.seq + 1, &mut stream(self.seed, VAL, i as u64, 0))
    }

    fn val_batches(&self, n: usize, batch: usize) -> Vec<Batch> {
        let all: Vec<Vec<u32>> = (0..n).map(|i| self.val_sequence(i).tokens).collect();
        all.chunks(batch.max(1))
            .map(|w| Batch::from_windows(w, self.seq))
            .collect()
    }

    /// Mean over the targets of the first `n` validation sequences of the
    /// exact entropy of each target given its prefix.
    fn val_floor(&self, n: usize) -> f64 {
        let total: f64 = (0..n)
            .map(|i| self.val_sequence(i).entropy[1..].iter().sum::<f64>())
            .sum();
        total / (n * self.seq) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_batches_are_pure_functions_of_position() {
        let opts = DatasetOptions {
            seq: 32,
            seed: 42,
            global_batch: 32,
        };
        let d = Dataset::open(&DataSpec::default(), &opts).unwrap();
        let a = d.train_batch(7, 1, 4).unwrap();
        assert_eq!(a, d.train_batch(7, 1, 4).unwrap());
        assert_ne!(a, d.train_batch(8, 1, 4).unwrap());
        assert_ne!(a, d.train_batch(7, 0, 4).unwrap());
        assert_eq!((a.batch, a.seq, a.inputs.len()), (4, 32, 128));
        // Targets are inputs shifted by one.
        assert_eq!(a.inputs[1..32], a.targets[..31]);
        let floor = d.val_floor(16).unwrap();
        assert!(floor > 0.5 && floor < 2.0, "{floor}");
        let val = d.val_batches(10, 4).unwrap();
        assert_eq!(
            val.iter().map(|b| b.batch).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
    }
}
