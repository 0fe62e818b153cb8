//! Training sequences from one corpus or a weighted blend of several.
//!
//! Each corpus' training tokens are cut into windows of `seq + 1` tokens
//! that start every `seq` tokens (packing: documents follow one another,
//! separated by end-of-text, and a window may span a boundary — attention
//! is not masked at it, as in GPT-2, nanoGPT and llm.c; see the crate docs
//! for that choice). Sample `g` of the run — `g = step · global_batch +
//! position in the batch` — is located in the blend by an
//! [`Interleave`], and within its corpus at local number `j` it is window
//! `Permutation(epoch = j / n, seed)(j mod n)`: every epoch is a fresh
//! shuffle, and nothing but `g` decides which window a sample is.

use crate::corpus::Corpus;
use crate::error::{DataError, Result};
use crate::order::{Interleave, Permutation, seed_of};

/// One corpus of a blend and its weight.
#[derive(Debug)]
pub struct Part {
    /// The corpus.
    pub corpus: Corpus,
    /// Its weight (any positive scale; shares are weight over the sum).
    pub weight: f64,
    train_windows: u64,
    val_windows: u64,
}

impl Part {
    /// Training windows of the corpus (sequences per epoch).
    pub fn train_windows(&self) -> u64 {
        self.train_windows
    }

    /// Validation windows of the corpus.
    pub fn val_windows(&self) -> u64 {
        self.val_windows
    }
}

/// Sequences for a run: a blend of corpora (one, weight 1, for a plain
/// source), in a seeded order.
#[derive(Debug)]
pub struct Loader {
    parts: Vec<Part>,
    seq: usize,
    seed: u64,
    interleave: Interleave,
}

/// What a blend gives over a number of samples.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Share {
    /// The corpus path.
    pub path: String,
    /// Its weight over the sum of weights.
    pub weight: f64,
    /// Samples it gives.
    pub samples: u64,
    /// `samples` over all samples: the realized proportion.
    pub fraction: f64,
    /// Epochs of its training windows those samples are.
    pub epochs: f64,
}

impl Loader {
    /// A loader of sequences of `seq` tokens (and their next-token
    /// targets) from `parts` (corpus, weight), ordered by `seed`.
    ///
    /// # Errors
    /// [`DataError::Blend`] for no parts or a weight that is not positive;
    /// [`DataError::TooShort`] for a split shorter than one sequence.
    pub fn new(parts: Vec<(Corpus, f64)>, seq: usize, seed: u64) -> Result<Self> {
        if parts.is_empty() {
            return Err(DataError::Blend("no datasets".into()));
        }
        let mut out = Vec::with_capacity(parts.len());
        for (corpus, weight) in parts {
            if !(weight.is_finite() && weight > 0.0) {
                return Err(DataError::Blend(format!(
                    "{}: weight {weight} is not a positive number",
                    corpus.path.display()
                )));
            }
            let need = seq as u64 + 1;
            for (split, s) in [("train", &corpus.train), ("validation", &corpus.val)] {
                if s.len() < need {
                    return Err(DataError::TooShort {
                        path: corpus.path.clone(),
                        split,
                        tokens: s.len(),
                        needed: need,
                    });
                }
            }
            let windows = |n: u64| (n - 1) / seq as u64;
            out.push(Part {
                train_windows: windows(corpus.train.len()),
                val_windows: windows(corpus.val.len()),
                corpus,
                weight,
            });
        }
        let weights: Vec<f64> = out.iter().map(|p| p.weight).collect();
        Ok(Self {
            interleave: Interleave::new(&weights, seed),
            parts: out,
            seq,
            seed,
        })
    }

    /// The corpora of the blend.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Tokens per sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Which corpus and which of its training windows sample `g` is.
    pub fn locate(&self, g: u64) -> (usize, u64) {
        let (d, j) = self.interleave.locate(g);
        let n = self.parts[d].train_windows;
        let (epoch, k) = (j / n, j % n);
        let perm = Permutation::new(n, seed_of(&[self.seed, d as u64, epoch]));
        (d, perm.apply(k))
    }

    /// Appends the `seq + 1` tokens of sample `g` to `out`.
    ///
    /// # Errors
    /// A damaged shard ([`DataError::Corrupt`]) or an id outside the
    /// vocabulary ([`DataError::TokenOutOfRange`]), naming the file.
    pub fn train_sequence(&self, g: u64, out: &mut Vec<u32>) -> Result<()> {
        let (d, w) = self.locate(g);
        let s = self.seq as u64;
        self.parts[d].corpus.train.read(w * s, s + 1, out)
    }

    /// The first `n` validation sequences (fewer if the validation splits
    /// hold fewer): the blend's interleave over each corpus' validation
    /// windows in order, a corpus dropping out when its windows run out.
    ///
    /// # Errors
    /// As [`train_sequence`](Self::train_sequence).
    pub fn val_sequences(&self, n: usize) -> Result<Vec<Vec<u32>>> {
        let s = self.seq as u64;
        let available: u64 = self.parts.iter().map(|p| p.val_windows).sum();
        let mut out = Vec::with_capacity(n.min(available as usize));
        let mut exhausted = vec![false; self.parts.len()];
        let mut g = 0;
        while out.len() < n && exhausted.iter().any(|e| !e) {
            let (d, j) = self.interleave.locate(g);
            g += 1;
            if j >= self.parts[d].val_windows {
                exhausted[d] = true;
                continue;
            }
            let mut w = Vec::with_capacity(self.seq + 1);
            self.parts[d].corpus.val.read(j * s, s + 1, &mut w)?;
            out.push(w);
        }
        Ok(out)
    }

    /// What each corpus gives over the first `samples` samples.
    pub fn shares(&self, samples: u64) -> Vec<Share> {
        let total: f64 = self.parts.iter().map(|p| p.weight).sum();
        self.interleave
            .counts(samples)
            .into_iter()
            .zip(&self.parts)
            .map(|(c, p)| Share {
                path: p.corpus.path.display().to_string(),
                weight: p.weight / total,
                samples: c,
                fraction: if samples == 0 {
                    0.0
                } else {
                    c as f64 / samples as f64
                },
                epochs: c as f64 / p.train_windows as f64,
            })
            .collect()
    }
}
