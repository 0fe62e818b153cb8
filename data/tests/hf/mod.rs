//! Hugging Face `tokenizer.json` tokenizers and ids wider than 16 bits:
//! ids byte-identical to the Python `tokenizers` library (tokenizers
//! trained by `python/hf_tokenizers.py`), `u32` storage, llm.c's Llama-3
//! shards and Megatron-LM's int32 files, and the errors of a wrong or
//! missing tokenizer.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;

use weft_data::{
    BlendEntry, Corpus, DataError, DataSpec, Dataset, DatasetOptions, Dtype, Format, Index,
    LLAMA3_BEGIN_OF_TEXT, LLAMA3_VOCAB, Loader, PrepareOptions, Source, Tokenizer, TokenizerSpec,
    prepare,
};

fn go() -> impl FnMut(&weft_data::Progress) -> ControlFlow<()> {
    |_| ControlFlow::Continue(())
}

fn with_tokenizer(path: &Path, shard_tokens: u64) -> PrepareOptions {
    PrepareOptions {
        shard_tokens,
        tokenizer: TokenizerSpec::File {
            path: path.to_owned(),
            eot: None,
        },
        ..PrepareOptions::default()
    }
}

/// Every document of a prepared folder (end-of-text included), from its
/// files, read in the index's dtype.
fn documents(dir: &Path) -> Vec<Vec<u32>> {
    let index = Index::read(&dir.join("index.json")).unwrap();
    let mut docs = Vec::new();
    for s in &index.shards {
        let b = std::fs::read(dir.join(&s.bin)).unwrap();
        let toks: Vec<u32> = match index.dtype {
            Dtype::U16 => b
                .chunks(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Dtype::U32 => b
                .chunks(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        };
        let mut start = 0;
        for c in std::fs::read(dir.join(&s.idx)).unwrap().chunks(8) {
            let end = u64::from_le_bytes(c.try_into().unwrap()) as usize;
            docs.push(toks[start..end].to_vec());
            start = end;
        }
    }
    docs
}

/// Every token of a corpus' training split, through a loader (windows of
/// one token, in corpus order).
fn train_tokens(c: Corpus) -> Vec<u32> {
    let loader = Loader::new(vec![(c, 1.0)], 1, 0).unwrap();
    let n = loader.parts()[0].train_windows();
    let mut v: Vec<(u64, u32)> = (0..n)
        .map(|g| {
            let mut w = Vec::new();
            loader.train_sequence(g, &mut w).unwrap();
            (loader.locate(g).1, w[0])
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, t)| t).collect()
}

#[test]
fn hugging_face_tokenizers_give_the_python_ids() {
    let Some(py) = super::python("numpy") else {
        return;
    };
    let ok = Command::new(&py)
        .args(["-c", "import tokenizers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("WEFT_REQUIRE_ALL").is_none(),
            "no Python `tokenizers` package, and WEFT_REQUIRE_ALL is set"
        );
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"SKIPPED: no Python `tokenizers` package (set WEFT_PYTHON)\n",
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/hf_tokenizers.py");
    let o = Command::new(&py).arg(script).arg(&dir).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let texts: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    let mut compared = 0;
    for name in ["bytelevel", "wordbpe", "llama3", "big"] {
        let json = dir.join(format!("{name}.json"));
        let tok = Tokenizer::from_file(&json, None).unwrap();
        let ids: Vec<Vec<u32>> = serde_json::from_value(want[name].clone()).unwrap();
        assert_eq!(tok.vocab_size() as u64, want["vocab"][name], "{name}");
        assert_eq!(u64::from(tok.end_of_text()), want["eot"][name], "{name}");
        // Encoding: the Python library's ids, document by document.
        for (i, (text, ids)) in texts.iter().zip(&ids).enumerate() {
            assert_eq!(
                &tok.encode(text).unwrap(),
                ids,
                "{name}, document {i}: {text:?}"
            );
            compared += ids.len();
            if name == "bytelevel" || name == "llama3" {
                assert_eq!(&tok.decode(ids), text, "byte-level BPE decodes losslessly");
            }
        }
        // `weft data prepare --tokenizer`: the same ids, each document
        // followed by end-of-text, stored in 16 bits while they fit.
        let out = tmp.path().join(format!("prepared-{name}"));
        let opts = with_tokenizer(&json, 300);
        let r = prepare(&[dir.join("docs")], &out, &opts, &mut go()).unwrap();
        assert_eq!(r.documents as usize, texts.len());
        let got = documents(&out);
        assert_eq!(got.len(), ids.len());
        for (i, (g, w)) in got.iter().zip(&ids).enumerate() {
            assert_eq!(g[..g.len() - 1], w[..], "{name}, prepared document {i}");
            assert_eq!(g[g.len() - 1], tok.end_of_text());
        }
        let index = Index::read(&out.join("index.json")).unwrap();
        let wide = name == "big";
        assert_eq!(index.dtype, if wide { Dtype::U32 } else { Dtype::U16 });
        assert_eq!(index.vocab_size, tok.vocab_size());
        assert_eq!(index.settings.tokenizer_xxh3, Some(tok.id()));
        assert!(index.shards.len() > 1, "{name}: several shards");
        // The folder carries its tokenizer, and is read as it was written.
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            std::fs::read(&json).unwrap()
        );
        let c = Corpus::open_for(&out, 0.2, Some(&tok)).unwrap();
        c.verify().unwrap();
        assert_eq!(c.vocab_size, Some(tok.vocab_size()));
        let all: Vec<u32> = got.concat();
        let train = train_tokens(c);
        assert_eq!(train[..], all[..train.len()]);
        if wide {
            // ids past 65,535 survive the u32 shards and the loader
            assert!(train.iter().any(|&t| t > 65_535), "{train:?}");
        }
        // And training on the text tokenizes it the same way, documents
        // joined by end-of-text.
        let spec = DataSpec {
            source: Source::Text(dir.join("docs")),
            tokenizer: Some(opts.tokenizer.clone()),
            ..DataSpec::default()
        };
        let d = Dataset::open(
            &spec,
            &DatasetOptions {
                seq: 8,
                seed: 0,
                global_batch: 1,
            },
        )
        .unwrap();
        assert_eq!(d.vocab_size(), tok.vocab_size());
        assert_eq!(d.end_of_text(), Some(tok.end_of_text()));
        let Dataset::Text(t) = &d else { panic!() };
        let joined: Vec<u32> = ids.join(&tok.end_of_text());
        let split = t.split_sizes().0;
        let val = d.val_batches(1000, 4).unwrap();
        let first = &val[0].inputs[..8];
        assert_eq!(first, &joined[split..split + 8]);
        let vals: Vec<u32> = val.iter().flat_map(|b| b.targets.clone()).collect();
        if wide {
            assert!(vals.iter().any(|&t| t > 65_535));
        }
        // a second open maps the token cache (u32 ids for the wide one)
        let again = Dataset::open(
            &spec,
            &DatasetOptions {
                seq: 8,
                seed: 0,
                global_batch: 1,
            },
        )
        .unwrap();
        assert_eq!(again.val_batches(1000, 4).unwrap(), val);
        assert_eq!(
            again.train_batch(3, 0, 2).unwrap(),
            d.train_batch(3, 0, 2).unwrap()
        );
        // The run's tokenizer, for `weft sample`: the prepared folder's
        // copy, found from the data alone.
        let run = DataSpec {
            source: Source::Tokens(out.clone()),
            ..DataSpec::default()
        };
        let found = run.run_tokenizer().unwrap().unwrap();
        assert_eq!(
            (found.id(), found.end_of_text()),
            (tok.id(), tok.end_of_text())
        );
        assert_eq!(run.token_ids().unwrap().vocab_size, tok.vocab_size());
    }
    let line = format!("{compared} ids compared with the Python tokenizers library\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    assert!(compared > 5000, "{compared}");
}

/// A word-level tokenizer.json: `words` get ids 1.., `[UNK]` 0, and
/// `</s>` the id `eot`.
fn word_level(dir: &Path, name: &str, words: &[&str], eot: u32) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for (i, w) in words.iter().enumerate() {
        vocab.insert((*w).into(), (i + 1).into());
    }
    vocab.insert("</s>".into(), eot.into());
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let path = dir.join(name);
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

fn text_folder(dir: &Path, docs: &[&str]) -> PathBuf {
    let text = dir.join("text");
    std::fs::create_dir_all(&text).unwrap();
    for (i, d) in docs.iter().enumerate() {
        std::fs::write(text.join(format!("{i:02}.txt")), d).unwrap();
    }
    text
}

#[test]
fn wide_ids_are_stored_in_32_bits() {
    let tmp = tempfile::tempdir().unwrap();
    // `</s>` at id 150,000: a vocabulary of 150,001 ids, as Qwen's is.
    let json = word_level(
        tmp.path(),
        "wide.json",
        &["alpha", "beta", "gamma"],
        150_000,
    );
    let docs = [
        "alpha beta",
        "gamma gamma alpha",
        "beta",
        "alpha delta beta",
    ];
    let text = text_folder(tmp.path(), &docs);
    let out = tmp.path().join("p");
    prepare(&[text], &out, &with_tokenizer(&json, 6), &mut go()).unwrap();
    let index = Index::read(&out.join("index.json")).unwrap();
    assert_eq!((index.dtype, index.vocab_size), (Dtype::U32, 150_001));
    assert_eq!(index.end_of_text, 150_000);
    let want = [
        vec![1, 2, 150_000],
        vec![3, 3, 1, 150_000],
        vec![2, 150_000],
        vec![1, 0, 2, 150_000],
    ];
    assert_eq!(documents(&out), want);
    let c = Corpus::open(&out, 0.25).unwrap();
    c.verify().unwrap();
    assert_eq!(train_tokens(c), [1, 2, 150_000, 3, 3, 1, 150_000, 2]);
}

/// llm.c's `write_datafile` for Llama-3: 256 int32 header [20240801, 7,
/// ntok, 0...], then uint32 ids.
fn llmc_llama3(path: &Path, ids: &[u32]) {
    let mut b = Vec::new();
    for (i, w) in [20_240_801i32, 7, ids.len() as i32]
        .iter()
        .chain(&[0; 253])
        .enumerate()
    {
        assert!(i < 256);
        b.extend(w.to_le_bytes());
    }
    for t in ids {
        b.extend(t.to_le_bytes());
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn llmc_llama3_shards_are_read() {
    let tmp = tempfile::tempdir().unwrap();
    // each document starts with <|begin_of_text|>, as llm.c's fineweb.py
    // tokenizes for Llama-3
    let mut ids = Vec::new();
    for d in 0..10u32 {
        ids.push(LLAMA3_BEGIN_OF_TEXT);
        ids.extend((0..20).map(|k| (d * 9_973 + k * 6_007) % 128_000 + 100));
    }
    ids[5] = 128_255; // the largest id
    let f = tmp.path().join("fineweb_train_000001.bin");
    llmc_llama3(&f, &ids);
    let c = Corpus::open(&f, 0.2).unwrap();
    assert_eq!(c.format, Format::LlmC);
    assert_eq!(c.vocab_size, Some(LLAMA3_VOCAB));
    assert_eq!(c.end_of_text, Some(LLAMA3_BEGIN_OF_TEXT));
    // split at the start of a document, about 20% held out
    let n = c.train.len() as usize;
    assert_eq!(ids[n], LLAMA3_BEGIN_OF_TEXT);
    assert_eq!(c.val.len(), 2 * 21);
    c.verify().unwrap();
    assert_eq!(train_tokens(c), ids[..n - 1]);
    // an id past Llama-3's vocabulary: an error naming the file
    let mut bad = ids.clone();
    bad[30] = 128_256;
    llmc_llama3(&f, &bad);
    let e = Corpus::open(&f, 0.2).unwrap().verify().unwrap_err();
    assert!(
        matches!(e, DataError::TokenOutOfRange { id: 128_256, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("fineweb_train_000001.bin"), "{e}");
    // another version: refused, naming what is read
    let mut b = std::fs::read(&f).unwrap();
    b[4] = 6;
    std::fs::write(&f, b).unwrap();
    let e = Corpus::open(&f, 0.2).unwrap_err().to_string();
    assert!(
        e.contains("version 6") && e.contains("20240801 version 7"),
        "{e}"
    );
}

/// Megatron-LM's `_IndexWriter` with int32 ids (dtype code 4), one
/// sequence per document.
fn megatron_int32(prefix: &Path, docs: &[Vec<u32>]) {
    let mut bin = Vec::new();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(4);
    idx.extend((docs.len() as u64).to_le_bytes());
    idx.extend((docs.len() as u64 + 1).to_le_bytes());
    for d in docs {
        idx.extend((d.len() as i32).to_le_bytes());
    }
    let mut at = 0i64;
    for d in docs {
        idx.extend(at.to_le_bytes());
        at += 4 * d.len() as i64;
        bin.extend(d.iter().flat_map(|t| t.to_le_bytes()));
    }
    for i in 0..=docs.len() as i64 {
        idx.extend(i.to_le_bytes());
    }
    std::fs::write(prefix.with_extension("bin"), bin).unwrap();
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
}

#[test]
fn megatron_int32_ids_take_the_named_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<u32>> = (0..6u32)
        .map(|d| {
            let mut v: Vec<u32> = (0..12).map(|k| (d * 7 + k) * 11_000 % 150_000).collect();
            v.push(150_000);
            v
        })
        .collect();
    let prefix = tmp.path().join("qwen_text_document");
    megatron_int32(&prefix, &docs);
    // Opened alone (weft data verify): ids unchecked, vocabulary unknown.
    let c = Corpus::open(&prefix, 0.2).unwrap();
    assert_eq!((c.vocab_size, c.end_of_text), (None, None));
    // Trained on: the vocabulary must come from a tokenizer.
    let opts = DatasetOptions {
        seq: 4,
        seed: 0,
        global_batch: 2,
    };
    let mut spec = DataSpec {
        source: Source::Tokens(prefix.clone()),
        ..DataSpec::default()
    };
    let e = Dataset::open(&spec, &opts).unwrap_err().to_string();
    assert!(
        e.contains("qwen_text_document") && e.contains("data.tokenizer"),
        "{e}"
    );
    let json = word_level(tmp.path(), "qwen.json", &["x"], 150_000);
    spec.tokenizer = Some(TokenizerSpec::named(json.to_str().unwrap(), None));
    let d = Dataset::open(&spec, &opts).unwrap();
    assert_eq!((d.vocab_size(), d.end_of_text()), (150_001, Some(150_000)));
    let b = d.train_batch(0, 0, 2).unwrap();
    assert!(b.inputs.iter().chain(&b.targets).all(|&t| t <= 150_000));
    // A tokenizer too small for the ids: the model's vocabulary would not
    // cover them, an error naming the file, the id and the vocabulary.
    let small = word_level(tmp.path(), "small.json", &["x"], 1000);
    let c = Corpus::open_for(
        &prefix,
        0.2,
        Some(&Tokenizer::from_file(&small, None).unwrap()),
    )
    .unwrap();
    let e = c.verify().unwrap_err().to_string();
    assert!(
        e.contains("qwen_text_document.bin") && e.contains("outside the vocabulary of 1001"),
        "{e}"
    );
}

#[test]
fn the_wrong_tokenizer_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let text = text_folder(
        tmp.path(),
        &["alpha beta", "beta gamma", "gamma alpha beta"],
    );
    let a = word_level(tmp.path(), "a.json", &["alpha", "beta", "gamma"], 9);
    let b = word_level(tmp.path(), "b.json", &["gamma", "beta", "alpha"], 9);
    let (pa, pg) = (tmp.path().join("pa"), tmp.path().join("pg"));
    prepare(
        std::slice::from_ref(&text),
        &pa,
        &with_tokenizer(&a, 100),
        &mut go(),
    )
    .unwrap();
    prepare(
        std::slice::from_ref(&text),
        &pg,
        &PrepareOptions::default(),
        &mut go(),
    )
    .unwrap();
    let tb = Tokenizer::from_file(&b, None).unwrap();
    // Data prepared with one tokenizer, used with another.
    let e = Corpus::open_for(&pa, 0.3, Some(&tb)).unwrap_err();
    assert!(matches!(e, DataError::TokenizerMismatch { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains("pa") && e.contains("b.json"), "{e}");
    let gpt2 = Tokenizer::gpt2().unwrap();
    let e = Corpus::open_for(&pa, 0.3, Some(&gpt2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not with the tokenizer named (gpt2)"), "{e}");
    let ta = Tokenizer::from_file(&a, None).unwrap();
    let e = Corpus::open_for(&pg, 0.3, Some(&ta))
        .unwrap_err()
        .to_string();
    assert!(e.contains("made with gpt2"), "{e}");
    Corpus::open_for(&pa, 0.3, Some(&ta)).unwrap();
    // A blend of the two: refused.
    let spec = DataSpec {
        source: Source::Blend(vec![
            BlendEntry {
                path: pg.display().to_string(),
                weight: 1.0,
            },
            BlendEntry {
                path: pa.display().to_string(),
                weight: 1.0,
            },
        ]),
        ..DataSpec::default()
    };
    let e = spec.token_ids().unwrap_err().to_string();
    assert!(e.contains("a blend trains the ids of one tokenizer"), "{e}");
    // A replaced copy of the tokenizer in the folder: refused by sampling.
    std::fs::copy(&b, pa.join("tokenizer.json")).unwrap();
    let run = DataSpec {
        source: Source::Tokens(pa.clone()),
        ..DataSpec::default()
    };
    let e = run.run_tokenizer().unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("replaced"),
        "{e}"
    );
    // Resuming or re-preparing a folder with another tokenizer: refused.
    let e = prepare(&[text], &pa, &with_tokenizer(&b, 100), &mut go())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer a tokenizer.json of xxh3"), "{e}");
}

#[test]
fn a_missing_or_invalid_tokenizer_json_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let text = text_folder(tmp.path(), &["some text"]);
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let no_eot = word_level(tmp.path(), "noeot.json", &["a"], 2);
    let json = std::fs::read_to_string(&no_eot)
        .unwrap()
        .replace("</s>", "<end>");
    std::fs::write(&no_eot, json).unwrap();
    for (file, want) in [
        (tmp.path().join("missing.json"), "missing.json: cannot read"),
        (bad.clone(), "bad.json: not a tokenizer.json weft reads"),
        (no_eot.clone(), "noeot.json: none of the end-of-text tokens"),
    ] {
        let out = tmp.path().join("out");
        let e = prepare(
            std::slice::from_ref(&text),
            &out,
            &with_tokenizer(&file, 100),
            &mut go(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(want), "{e:?} should contain {want:?}");
        assert!(!out.exists(), "nothing written");
    }
    // --eot names a token it has.
    let out = tmp.path().join("out");
    let opts = PrepareOptions {
        tokenizer: TokenizerSpec::named(no_eot.to_str().unwrap(), Some("<end>")),
        ..PrepareOptions::default()
    };
    prepare(&[text], &out, &opts, &mut go()).unwrap();
    let index = Index::read(&out.join("index.json")).unwrap();
    assert_eq!(index.end_of_text, 2);
    assert_eq!(index.settings.end_of_text_token.as_deref(), Some("<end>"));
}
