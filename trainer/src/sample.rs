//! `weft sample`: text from the last saved weights of a run folder.
//!
//! [`Sampler::open`] reads a run's `config.toml` (the model's shape and its
//! data) and loads the newest checkpoint under `checkpoints/` that
//! verifies. [`Sampler::generate`] then decodes incrementally with
//! [`weft_model::Decoder`]'s key/value cache — whose logits are bitwise
//! the training forward's — greedily (`temperature = 0`) or by sampling
//! from the softmax of `logits / temperature`, optionally limited to the
//! `top_k` most likely tokens, with a seeded generator: the same options
//! give the same tokens.
//!
//! Runs on text or token data take and print text, through the run's
//! tokenizer (GPT-2's BPE, or the `tokenizer.json` that `data.tokenizer`
//! names or the prepared data carries); runs on the synthetic
//! corpus take and print token ids, markers written `<M0>`, `<M1>`, ...
//! (see [`SyntheticLanguage::render`]). Past `block_size` positions, the
//! context slides: the newest half of the block is fed again and decoding
//! goes on from there.
//!
//! # Example
//! ```no_run
//! use weft_trainer::sample::{SampleOptions, Sampler};
//!
//! let sampler = Sampler::open(std::path::Path::new("runs/demo"))?;
//! let prompt = sampler.encode_prompt(Some("12 7 <M3>"))?;
//! let opts = SampleOptions { tokens: 50, temperature: 0.8, top_k: 20, seed: 1 };
//! let out = sampler.generate(&prompt, &opts)?;
//! println!("{}{}", sampler.render(&prompt), sampler.render(&out));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::{Path, PathBuf};

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use weft_model::{Decoder, Gpt, MoeStats, Sampling};

use crate::config::{Config, ConfigError};
use crate::train::CkptError;
use weft_data::SyntheticLanguage;
use weft_data::synthetic::SpecError;

/// Why sampling failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SampleError {
    /// The run folder does not exist or has no `config.toml`.
    #[error("{0}: not a run folder (no config.toml; runs are written by `weft train`)")]
    NoRun(PathBuf),
    /// The run's `config.toml` is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The run saved no checkpoint.
    #[error(
        "{0}: no checkpoint to sample from (the run saves every checkpoint.every steps and at \
         the end; was it stopped before its first save, or run with checkpoint.every = 0?)"
    )]
    NoCheckpoint(PathBuf),
    /// Loading the checkpoint failed.
    #[error(transparent)]
    Checkpoint(CkptError),
    /// The model rejected the configuration or the input.
    #[error("model: {0}")]
    Model(#[from] weft_model::Error),
    /// The run's synthetic language settings are invalid.
    #[error(transparent)]
    Synthetic(#[from] SpecError),
    /// The run's tokenizer could not be loaded, or fails on the prompt.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The prompt could not be read or does not fit.
    #[error("--prompt: {0}")]
    Prompt(String),
    /// A sampling option is out of range.
    #[error("--{option}: {reason}")]
    Option {
        /// The option.
        option: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The model cannot be decoded token by token.
    #[error("{0}")]
    Unsupported(String),
    /// The run's model is larger than this machine's memory.
    #[error(transparent)]
    Memory(Box<crate::train::TrainError>),
}

/// How to continue a prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Sample only among the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Seed of the sampling generator.
    pub seed: u64,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            tokens: 100,
            temperature: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// How tokens are read and written.
#[derive(Debug)]
enum Vocab {
    Text(weft_data::Tokenizer),
    Synthetic(SyntheticLanguage),
}

/// A trained model loaded from a run folder, ready to generate.
#[derive(Debug)]
pub struct Sampler {
    config: Config,
    model: Gpt,
    vocab: Vocab,
    step: u64,
    moe: Option<MoeStats>,
}

impl Sampler {
    /// Loads the newest valid checkpoint of the run folder `run_dir`.
    ///
    /// # Errors
    /// [`SampleError::NoRun`] without a `config.toml`,
    /// [`SampleError::Config`] if it is invalid,
    /// [`SampleError::NoCheckpoint`] if no checkpoint was saved,
    /// [`SampleError::Checkpoint`] if loading fails,
    /// [`SampleError::Unsupported`] for a mixture of experts whose router
    /// has a capacity limit (a token's experts then depend on other tokens).
    pub fn open(run_dir: &Path) -> Result<Self, SampleError> {
        let config_path = run_dir.join("config.toml");
        if !config_path.is_file() {
            return Err(SampleError::NoRun(run_dir.to_owned()));
        }
        let config = Config::load(Some(&config_path), &[])?;
        let tokenizer = |e: weft_data::DataError| SampleError::Tokenizer(e.to_string());
        let vocab = match config.data.run_tokenizer().map_err(tokenizer)? {
            Some(t) => Vocab::Text(t),
            None => Vocab::Synthetic(SyntheticLanguage::new(config.data.synthetic.clone())?),
        };
        // the model's vocabulary and document boundary, as training had them
        let ids = config.data.token_ids().map_err(tokenizer)?;
        crate::run::setup::check_model_floor(&config).map_err(|e| SampleError::Memory(e.into()))?;
        let (mut model, moe) = build_model(&config, ids)?;
        let root = run_dir.join("checkpoints");
        if !root.is_dir() {
            return Err(SampleError::NoCheckpoint(run_dir.to_owned()));
        }
        let step = match crate::run::saving::restore(&root, &config, &mut model) {
            Ok(r) => r,
            Err(CkptError::Missing(_)) => {
                return Err(SampleError::NoCheckpoint(run_dir.to_owned()));
            }
            Err(e) => return Err(SampleError::Checkpoint(e)),
        };
        Ok(Sampler {
            config,
            model,
            vocab,
            step,
            moe,
        })
    }

    /// A Hugging Face folder's model (GPT-2 or the Llama family, as
    /// [`weft_model::hf::load`] reads it) with `tokenizer` (default: the
    /// folder's `tokenizer.json`, else GPT-2's BPE for a 50,257-token
    /// model). Its [`config`](Self::config) is the default one with the
    /// folder's context length; [`step`](Self::step) is 0.
    ///
    /// # Errors
    /// [`SampleError::Model`] for a folder weft cannot load,
    /// [`SampleError::Tokenizer`] without a tokenizer or with one whose
    /// vocabulary is larger than the model's.
    pub fn open_hf(dir: &Path, tokenizer: Option<&Path>) -> Result<Self, SampleError> {
        let model = weft_model::hf::load(dir)?;
        let v = model.config().vocab_size;
        let own = dir.join("tokenizer.json");
        let text = match tokenizer.or(own.is_file().then_some(own.as_path())) {
            Some(path) => weft_data::Tokenizer::from_file(path, None),
            None if v == weft_data::GPT2_VOCAB => weft_data::Tokenizer::gpt2(),
            None => {
                return Err(SampleError::Tokenizer(format!(
                    "{} has no tokenizer.json and its {v}-token vocabulary is not GPT-2's: \
                     give one with --tokenizer FILE",
                    dir.display()
                )));
            }
        }
        .map_err(|e| SampleError::Tokenizer(e.to_string()))?;
        if text.vocab_size() > v {
            return Err(SampleError::Tokenizer(format!(
                "its {} ids do not fit the model's {v}-token vocabulary",
                text.vocab_size()
            )));
        }
        let mut config = Config::default();
        config.model.block_size = model.config().block_size;
        Ok(Sampler {
            config,
            model,
            vocab: Vocab::Text(text),
            step: 0,
            moe: None,
        })
    }

    /// The run's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The loaded model.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// The training step of the loaded checkpoint.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Bytes a generation allocates up front: `(key/value cache, everything
    /// the decoder holds)` (see [`Decoder::bytes`]).
    pub fn memory(&self) -> (usize, usize) {
        let dec = Decoder::new(&self.model);
        (dec.kv_bytes(), dec.bytes())
    }

    /// Whether the run's tokens are text (else synthetic ids).
    pub fn is_text(&self) -> bool {
        matches!(self.vocab, Vocab::Text(_))
    }

    /// The prompt's token ids: text encoded with the run's tokenizer, or for a
    /// synthetic run ids separated by spaces or commas (markers also as
    /// `<M3>`). Without a prompt: the end-of-text token for text, and for a
    /// synthetic run the token 0 (a regular token, as every sequence
    /// starts with one).
    ///
    /// # Errors
    /// [`SampleError::Prompt`] if the prompt is empty, holds an id outside
    /// the vocabulary or something that is not an id, or is longer than
    /// `block_size` tokens.
    pub fn encode_prompt(&self, prompt: Option<&str>) -> Result<Vec<u32>, SampleError> {
        let tokens = match (&self.vocab, prompt) {
            (Vocab::Text(t), None) => vec![t.end_of_text()],
            (Vocab::Synthetic(_), None) => vec![0],
            (Vocab::Text(t), Some(p)) => t
                .encode_with_special_tokens(p)
                .map_err(|e| SampleError::Tokenizer(e.to_string()))?,
            (Vocab::Synthetic(lang), Some(p)) => lang
                .parse(p)
                .map_err(|e| SampleError::Prompt(e.to_string()))?,
        };
        let block = self.config.model.block_size;
        if tokens.is_empty() {
            return Err(SampleError::Prompt("is empty".into()));
        }
        if tokens.len() > block {
            return Err(SampleError::Prompt(format!(
                "is {} tokens, longer than the model's block_size = {block}",
                tokens.len()
            )));
        }
        Ok(tokens)
    }

    /// `tokens` as text (text runs; invalid UTF-8 is replaced) or as ids
    /// (synthetic runs, see [`SyntheticLanguage::render`]).
    pub fn render(&self, tokens: &[u32]) -> String {
        match &self.vocab {
            Vocab::Text(t) => t.decode(tokens),
            Vocab::Synthetic(lang) => {
                let mut s = lang.render(tokens);
                s.push(' ');
                s
            }
        }
    }

    /// Generates `opts.tokens` tokens after `prompt` (not repeated in the
    /// result).
    ///
    /// # Errors
    /// [`SampleError::Option`] for a negative or non-finite temperature;
    /// [`SampleError::Prompt`] for an empty prompt, one longer than
    /// `block_size`, or an id outside the vocabulary.
    pub fn generate(&self, prompt: &[u32], opts: &SampleOptions) -> Result<Vec<u32>, SampleError> {
        if opts.tokens > 1 << 20 {
            return Err(SampleError::Option {
                option: "tokens",
                reason: format!("is {}, at most 1048576 per sample", opts.tokens),
            });
        }
        if !(opts.temperature >= 0.0 && opts.temperature.is_finite()) {
            return Err(SampleError::Option {
                option: "temperature",
                reason: format!("is {}, must be 0 (greedy) or positive", opts.temperature),
            });
        }
        let block = self.config.model.block_size;
        let v = self.model.config().vocab_size;
        if prompt.is_empty() || prompt.len() > block {
            return Err(SampleError::Prompt(format!(
                "has {} tokens; need 1 to block_size = {block}",
                prompt.len()
            )));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= v) {
            return Err(SampleError::Prompt(format!(
                "token {bad} is outside the vocabulary of {v}"
            )));
        }
        let mut rng = Pcg64::seed_from_u64(opts.seed);
        #[allow(clippy::cast_precision_loss)]
        let mut uniform = || (rng.next_u64() >> 11) as f64 * (-53f64).exp2();
        let sampling = Sampling {
            temperature: opts.temperature,
            top_k: opts.top_k,
        };
        Ok(Decoder::new(&self.model).generate(
            prompt,
            opts.tokens,
            sampling,
            &mut uniform,
            &mut || self.drain_moe_log(),
        )?)
    }

    fn drain_moe_log(&self) {
        if let Some(stats) = &self.moe {
            stats.take();
        }
    }
}

/// The model a run trains (as `train` builds it: dense, or mixture of
/// experts per `[model.moe]`, in its `train.precision`), with its MoE
/// statistics handle.
fn build_model(
    config: &Config,
    ids: weft_data::TokenIds,
) -> Result<(Gpt, Option<MoeStats>), SampleError> {
    let cfg = crate::run::build::model_config(config, ids.vocab_size);
    let m = &config.model.moe;
    if m.experts > 0 && m.capacity_factor > 0.0 {
        return Err(SampleError::Unsupported(format!(
            "model.moe.capacity_factor = {}: with a capacity limit a token's experts depend on \
             the other tokens of the batch, so the model cannot be decoded token by token \
             (sampling supports dropless routers)",
            m.capacity_factor
        )));
    }
    let (ffn, stats) = config.model.ffn(None)?;
    let mut model = Gpt::from_blocks(weft_model::GptBlocks::new(cfg, ffn)?);
    // decode in the run's arithmetic: the training forward's bits
    model.set_precision(config.train.precision);
    model.set_doc_boundary(config.data.doc_boundary(ids.end_of_text));
    Ok((model, stats))
}
