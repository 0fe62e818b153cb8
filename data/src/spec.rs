//! What a run trains on, as one value: the `[data]` table of a job file.
//!
//! The table keeps the keys job files have always had — `source` (the
//! string `"synthetic"` or a path), `blend` (a list of datasets and
//! weights), `val_fraction`, `synthetic`, `doc_mask` — but is read into a
//! typed [`Source`]: the synthetic corpus, text tokenized when the run
//! starts, prepared token data, or a blend of token data. Which a path is
//! (text or token data) is decided by what is there
//! ([`Corpus::is_token_data`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::corpus::{Corpus, END_OF_TEXT};
use crate::synthetic::SyntheticSpec;

/// Where a run's tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// The built-in synthetic language (`data.synthetic`), whose loss
    /// floor is known exactly.
    Synthetic,
    /// A `.txt` file or a folder of them, tokenized with GPT-2's BPE when
    /// the run starts (and cached).
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

    /// Whether the data is made of documents separated by GPT-2's
    /// `<|endoftext|>` (everything but the synthetic corpus).
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
    /// packed before them. Text and token data only (GPT-2's
    /// `<|endoftext|>` ends a document).
    pub doc_mask: bool,
}

impl Default for DataSpec {
    fn default() -> Self {
        Self {
            source: Source::Synthetic,
            val_fraction: 0.1,
            synthetic: SyntheticSpec::default(),
            doc_mask: false,
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
    /// The token that ends a document under `doc_mask` (GPT-2's
    /// `<|endoftext|>`), or `None` without document masking.
    #[must_use]
    pub fn doc_boundary(&self) -> Option<u32> {
        self.doc_mask.then_some(END_OF_TEXT)
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
                }
            }
            Source::Text(_) | Source::Tokens(_) => {}
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
        Ok(DataSpec {
            source,
            val_fraction: t.val_fraction,
            synthetic: t.synthetic,
            doc_mask: t.doc_mask,
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
        DataTable {
            source,
            val_fraction: s.val_fraction,
            synthetic: s.synthetic,
            blend,
            doc_mask: s.doc_mask,
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
        for spec in [DataSpec::default(), s, blend] {
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
