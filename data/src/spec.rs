//! What a run trains on, as one value: the `[data]` table of a job file.
//!
//! The table keeps the keys job files have always had — `source` (the
//! string `"synthetic"` or a path), `blend` (a list of datasets and
//! weights), `val_fraction`, `synthetic`, `doc_mask`, and `tokenizer` /
//! `eot` (GPT-2's BPE or a Hugging Face `tokenizer.json`) — but is read
//! into a typed [`Source`]: the synthetic corpus, text tokenized when the run
//! starts, prepared token data, or a blend of token data. Which a path is
//! (text or token data) is decided by what is there
//! ([`Corpus::is_token_data`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::corpus::Corpus;
use crate::error::DataError;
use crate::synthetic::SyntheticSpec;
use crate::tokenizer::{GPT2, Tokenizer, TokenizerSpec};

/// Where a run's tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// The built-in synthetic language (`data.synthetic`), whose loss
    /// floor is known exactly.
    Synthetic,
    /// A `.txt` file or a folder of them, tokenized with the run's
    /// tokenizer (GPT-2's BPE unless `data.tokenizer` names one) when the
    /// run starts (and cached).
    Text(PathBuf),
    /// Token data prepared once and memory-mapped: a folder of `weft data
    /// prepare`, a Megatron-LM `.bin`/`.idx` pair (or their prefix), or
    /// llm.c `.bin` shards.
    Tokens(PathBuf),
    /// Several token datasets sampled by weight.
    Blend(Vec<BlendEntry>),
}

impl Source {
    /// The source a job file's `data.source` string names: `"synthetic"`,
    /// or a path — token data if it holds some, else text.
    #[must_use]
    pub fn named(source: &str) -> Source {
        if source == SYNTHETIC {
            return Source::Synthetic;
        }
        let path = PathBuf::from(source);
        if Corpus::is_token_data(&path) {
            Source::Tokens(path)
        } else {
            Source::Text(path)
        }
    }

    /// Whether the data is made of documents separated by an end-of-text
    /// token (everything but the synthetic corpus).
    #[must_use]
    pub fn has_documents(&self) -> bool {
        !matches!(self, Source::Synthetic)
    }
}

/// One dataset of a [`Source::Blend`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlendEntry {
    /// Prepared token data (as `data.source` accepts).
    pub path: String,
    /// Its weight; shares are weights over their sum.
    pub weight: f64,
}

/// The smallest share of a blend one dataset may have (its weight over
/// the weights' sum): a dataset drawn less often than this would not be
/// reached in any real run, and waiting for it would not end.
pub const MIN_BLEND_SHARE: f64 = 1e-6;

/// The value of `data.source` that names the synthetic corpus.
pub const SYNTHETIC: &str = "synthetic";

/// A job's data: the `[data]` table.
///
/// ```
/// use weft_data::{DataSpec, Source};
///
/// let spec: DataSpec = toml::from_str("source = \"synthetic\"\nval_fraction = 0.2\n").unwrap();
/// assert_eq!(spec.source, Source::Synthetic);
/// assert_eq!(spec.val_fraction, 0.2);
/// spec.validate().unwrap();
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DataTable", into = "DataTable")]
pub struct DataSpec {
    /// Where the tokens come from.
    pub source: Source,
    /// Fraction of the data held out for validation, in (0, 0.5]: of the
    /// tokens for text, at a document boundary for token data.
    pub val_fraction: f64,
    /// The synthetic language, for [`Source::Synthetic`].
    pub synthetic: SyntheticSpec,
    /// Document masking: train every document packed into a sequence as
    /// if it were alone — attention stops at the end-of-text token before
    /// it and positions restart after it (Megatron-LM's
    /// `reset_attention_mask` and `reset_position_ids`). Off by default,
    /// as GPT-2, nanoGPT and llm.c train: documents then see the ones
    /// packed before them. Text and token data only (the tokenizer's
    /// end-of-text token ends a document).
    pub doc_mask: bool,
    /// The tokenizer (`data.tokenizer`: `"gpt2"` or a `tokenizer.json`,
    /// and `data.eot`, its end-of-text token). `None`: text is tokenized
    /// with GPT-2's BPE, and token data is used with the tokenizer it
    /// records. When named, prepared data must have been made with it.
    pub tokenizer: Option<TokenizerSpec>,
}

/// What a model needs to know of its data's ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenIds {
    /// Size of the id space: the model's vocabulary size.
    pub vocab_size: usize,
    /// The token between documents (none for the synthetic corpus).
    pub end_of_text: Option<u32>,
}

impl Default for DataSpec {
    fn default() -> Self {
        Self {
            source: Source::Synthetic,
            val_fraction: 0.1,
            synthetic: SyntheticSpec::default(),
            doc_mask: false,
            tokenizer: None,
        }
    }
}

/// Why a [`DataSpec`] is unusable: the key of the `[data]` table
/// (`source`, `blend[2].weight`, ...) and what is wrong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("data.{field}: {problem}")]
pub struct DataSpecError {
    /// The key within `[data]`.
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

impl DataSpec {
    /// The token that ends a document under `doc_mask` — the data's
    /// `end_of_text` ([`TokenIds::end_of_text`],
    /// [`Dataset::end_of_text`](crate::Dataset::end_of_text)) — or `None`
    /// without document masking.
    #[must_use]
    pub fn doc_boundary(&self, end_of_text: Option<u32>) -> Option<u32> {
        end_of_text.filter(|_| self.doc_mask)
    }

    /// The tokenizer `data.tokenizer` names, loaded (`None` when unset).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] naming the file.
    pub fn named_tokenizer(&self) -> Result<Option<Tokenizer>, DataError> {
        self.tokenizer.as_ref().map(TokenizerSpec::load).transpose()
    }

    /// The tokenizer of the run's ids, to encode prompts and decode
    /// samples: the one named, else GPT-2's for text, else the one token
    /// data records (a prepared folder's copy of its `tokenizer.json`;
    /// GPT-2's for llm.c GPT-2 shards and `uint16` Megatron-LM files);
    /// `None` for the synthetic corpus.
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] when it cannot be loaded or the data does
    /// not record it (name it with `data.tokenizer`); the data's errors.
    pub fn run_tokenizer(&self) -> Result<Option<Tokenizer>, DataError> {
        if let Some(t) = self.named_tokenizer()? {
            return Ok(Some(t));
        }
        let first = match &self.source {
            Source::Synthetic => return Ok(None),
            Source::Text(_) => return Tokenizer::gpt2().map(Some),
            Source::Tokens(p) => p.clone(),
            Source::Blend(b) => PathBuf::from(&b.first().map_or("", |b| b.path.as_str())),
        };
        let c = Corpus::open(&first, self.val_fraction)?;
        match (&c.prepared, c.tokenizer.as_deref()) {
            (Some(p), _) => p.tokenizer().map(Some),
            (None, Some(GPT2)) => Tokenizer::gpt2().map(Some),
            (None, _) if c.vocab_size == Some(crate::GPT2_VOCAB) => Tokenizer::gpt2().map(Some),
            _ => Err(DataError::Tokenizer {
                path: first,
                what: "the data does not record its tokenizer: name its tokenizer.json with data.tokenizer".into(),
            }),
        }
    }

    /// The data's id space and end-of-text token, without reading the
    /// data (token data's headers are read).
    ///
    /// # Errors
    /// As [`Dataset::open`](crate::Dataset::open) for the tokenizer and
    /// the headers.
    pub fn token_ids(&self) -> Result<TokenIds, DataError> {
        match &self.source {
            Source::Synthetic => Ok(TokenIds {
                vocab_size: crate::SyntheticLanguage::new(self.synthetic.clone())?.vocab_size(),
                end_of_text: None,
            }),
            Source::Text(_) => {
                let t = match self.named_tokenizer()? {
                    Some(t) => t,
                    None => Tokenizer::gpt2()?,
                };
                Ok(TokenIds {
                    vocab_size: t.vocab_size(),
                    end_of_text: Some(t.end_of_text()),
                })
            }
            Source::Tokens(_) | Source::Blend(_) => {
                crate::dataset::open_corpora(&self.parts(), self).map(|(_, ids)| ids)
            }
        }
    }

    /// The token datasets and their weights (one, weight 1, for
    /// [`Source::Tokens`]; none for the others).
    pub(crate) fn parts(&self) -> Vec<(PathBuf, f64)> {
        match &self.source {
            Source::Tokens(p) => vec![(p.clone(), 1.0)],
            Source::Blend(b) => b
                .iter()
                .map(|b| (PathBuf::from(&b.path), b.weight))
                .collect(),
            Source::Synthetic | Source::Text(_) => Vec::new(),
        }
    }

    /// Checks the settings (the synthetic language only when it is the
    /// source).
    ///
    /// # Errors
    /// A [`DataSpecError`] naming the key.
    pub fn validate(&self) -> Result<(), DataSpecError> {
        let bad = |field: String, problem: String| Err(DataSpecError { field, problem });
        if !(self.val_fraction > 0.0 && self.val_fraction <= 0.5) {
            return bad(
                "val_fraction".into(),
                format!("must be in (0, 0.5] (got {})", self.val_fraction),
            );
        }
        match &self.source {
            Source::Synthetic => {
                if self.doc_mask {
                    return bad(
                        "doc_mask".into(),
                        "needs documents: the synthetic corpus has none; set data.source to text or token data".into(),
                    );
                }
                crate::synthetic::SyntheticLanguage::new(self.synthetic.clone()).map_err(|e| {
                    DataSpecError {
                        field: format!("synthetic.{}", e.field),
                        problem: e.problem,
                    }
                })?;
            }
            Source::Text(p) | Source::Tokens(p) if p.as_os_str().is_empty() => {
                return bad(
                    "source".into(),
                    "must be \"synthetic\", a path to .txt data, or prepared token data".into(),
                );
            }
            Source::Blend(entries) => {
                let total: f64 = entries.iter().map(|b| b.weight).sum();
                for (i, b) in entries.iter().enumerate() {
                    if b.path.is_empty() {
                        return bad(format!("blend[{i}].path"), "must name a dataset".into());
                    }
                    if !(b.weight.is_finite() && b.weight > 0.0) {
                        return bad(
                            format!("blend[{i}].weight"),
                            format!("must be a positive number (got {})", b.weight),
                        );
                    }
                    // shares are weights over their sum: a sum that
                    // overflows, or a share the interleave would never
                    // reach, is refused (it would drop or never end)
                    if !total.is_finite() || b.weight / total < MIN_BLEND_SHARE {
                        return bad(
                            format!("blend[{i}].weight"),
                            format!(
                                "= {:e} is a share of {:e} of the weights' sum {total:e}; each share must be at least {MIN_BLEND_SHARE:e} and the sum finite",
                                b.weight,
                                b.weight / total
                            ),
                        );
                    }
                }
            }
            Source::Text(_) | Source::Tokens(_) => {}
        }
        match &self.tokenizer {
            Some(_) if self.source == Source::Synthetic => {
                return bad(
                    "tokenizer".into(),
                    "the synthetic corpus has ids of its own; a tokenizer is for text and token data".into(),
                );
            }
            Some(TokenizerSpec::File { path, .. }) if path.as_os_str().is_empty() => {
                return bad(
                    "tokenizer".into(),
                    "must be \"gpt2\" or the path of a tokenizer.json".into(),
                );
            }
            _ => {}
        }
        Ok(())
    }
}

/// `[data]` as a job file writes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataTable {
    source: String,
    val_fraction: f64,
    synthetic: SyntheticSpec,
    blend: Vec<BlendEntry>,
    doc_mask: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokenizer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    eot: Option<String>,
}

impl Default for DataTable {
    fn default() -> Self {
        DataSpec::default().into()
    }
}

impl TryFrom<DataTable> for DataSpec {
    type Error = DataSpecError;

    fn try_from(t: DataTable) -> Result<Self, DataSpecError> {
        let source = if t.blend.is_empty() {
            Source::named(&t.source)
        } else if t.source == SYNTHETIC {
            Source::Blend(t.blend)
        } else {
            return Err(DataSpecError {
                field: "blend".into(),
                problem: format!(
                    "replaces data.source; set one of them (data.source = {:?})",
                    t.source
                ),
            });
        };
        // "" is unset too (job files written before these keys were optional)
        let eot = t.eot.as_deref().filter(|e| !e.is_empty());
        let tokenizer = t
            .tokenizer
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|n| TokenizerSpec::named(n, eot));
        if eot.is_some() && !matches!(tokenizer, Some(TokenizerSpec::File { .. })) {
            return Err(DataSpecError {
                field: "eot".into(),
                problem: "names the end-of-text token of a tokenizer.json: set data.tokenizer to one (GPT-2's is <|endoftext|>)".into(),
            });
        }
        Ok(DataSpec {
            source,
            val_fraction: t.val_fraction,
            synthetic: t.synthetic,
            doc_mask: t.doc_mask,
            tokenizer,
        })
    }
}

impl From<DataSpec> for DataTable {
    fn from(s: DataSpec) -> Self {
        let (source, blend) = match s.source {
            Source::Synthetic => (SYNTHETIC.to_owned(), Vec::new()),
            Source::Text(p) | Source::Tokens(p) => (p.to_string_lossy().into_owned(), Vec::new()),
            Source::Blend(b) => (SYNTHETIC.to_owned(), b),
        };
        let (tokenizer, eot) = match s.tokenizer {
            None => (None, None),
            Some(TokenizerSpec::Gpt2) => (Some(GPT2.to_owned()), None),
            Some(TokenizerSpec::File { path, eot }) => {
                (Some(path.to_string_lossy().into_owned()), eot)
            }
        };
        DataTable {
            source,
            val_fraction: s.val_fraction,
            synthetic: s.synthetic,
            blend,
            doc_mask: s.doc_mask,
            tokenizer,
            eot,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<DataSpec, String> {
        toml::from_str::<DataSpec>(text).map_err(|e| e.to_string())
    }

    #[test]
    fn the_table_reads_into_a_typed_source_and_writes_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let txt = dir.path().join("a.txt");
        std::fs::write(&txt, "text").unwrap();
        let s = parse(&format!("source = {:?}\n", txt.display().to_string())).unwrap();
        assert_eq!(s.source, Source::Text(txt.clone()));
        let blend =
            parse("[[blend]]\npath = \"a\"\nweight = 1.0\n[[blend]]\npath = \"b\"\nweight = 3.0\n")
                .unwrap();
        assert!(matches!(&blend.source, Source::Blend(b) if b.len() == 2));
        let tok = parse("tokenizer = \"t/tokenizer.json\"\neot = \"</s>\"\n").unwrap();
        assert_eq!(
            tok.tokenizer,
            Some(TokenizerSpec::named("t/tokenizer.json", Some("</s>")))
        );
        let e = parse("eot = \"</s>\"\n").unwrap_err();
        assert!(e.contains("data.eot: names the end-of-text"), "{e}");
        // unset keys are left out, and the old spelling of unset reads as it
        let text = toml::to_string(&DataSpec::default()).unwrap();
        assert!(
            !text.contains("tokenizer") && !text.contains("eot"),
            "{text}"
        );
        let old = parse("tokenizer = \"\"\neot = \"\"\n").unwrap();
        assert_eq!(old, DataSpec::default());
        for spec in [DataSpec::default(), s, blend, tok] {
            let text = toml::to_string(&spec).unwrap();
            assert_eq!(parse(&text).unwrap(), spec, "{text}");
        }
        let e = parse("source = \"x.txt\"\n[[blend]]\npath = \"a\"\nweight = 1.0\n").unwrap_err();
        assert!(e.contains("data.blend: replaces data.source"), "{e}");
        let e = parse("sauce = 1\n").unwrap_err();
        assert!(e.contains("unknown field `sauce`"), "{e}");
    }

    #[test]
    fn checks_name_their_key() {
        let field = |s: DataSpec| s.validate().unwrap_err().field;
        let d = DataSpec::default();
        assert_eq!(
            field(DataSpec {
                val_fraction: 0.9,
                ..d.clone()
            }),
            "val_fraction"
        );
        assert_eq!(
            field(DataSpec {
                doc_mask: true,
                ..d.clone()
            }),
            "doc_mask"
        );
        let mut bad_lang = d.clone();
        bad_lang.synthetic.regular = 1;
        assert_eq!(field(bad_lang), "synthetic.regular");
        let blend = DataSpec {
            source: Source::Blend(vec![BlendEntry {
                path: "a".into(),
                weight: -1.0,
            }]),
            ..d
        };
        assert_eq!(field(blend), "blend[0].weight");
    }
}
