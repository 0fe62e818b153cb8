//! weft-data end to end: prepare a corpus of many small files, read it
//! back, resume, detect damage, and read Megatron-LM and llm.c files
//! written by a script that follows their published formats.

mod hf;

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;

use weft_data::{Corpus, DataError, END_OF_TEXT, Format, Index, Loader, PrepareOptions, prepare};
use weft_testkit::python;

/// 60 text files (two folders deep), a .jsonl, a .jsonl.gz and a .txt.gz,
/// plus files that are not inputs.
fn corpus(dir: &Path) -> PathBuf {
    let root = dir.join("corpus");
    std::fs::create_dir_all(root.join("deep/er")).unwrap();
    let words = [
        "alpha", "beta", "gamma", "delta", "the", "quick", "fox", "über", "日本",
    ];
    let doc = |i: usize| -> String {
        (0..20 + (i * 7) % 50)
            .map(|k| words[(i * 31 + k * 17) % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    for i in 0..60 {
        let sub = match i % 3 {
            0 => root.clone(),
            1 => root.join("deep"),
            _ => root.join("deep/er"),
        };
        std::fs::write(sub.join(format!("doc{i:03}.txt")), doc(i)).unwrap();
    }
    let mut jsonl = String::new();
    for i in 60..90 {
        jsonl.push_str(&serde_json::json!({"id": i, "text": doc(i)}).to_string());
        jsonl.push('\n');
    }
    jsonl.push('\n'); // a blank line is not a document
    jsonl.push_str(&serde_json::json!({"text": ""}).to_string()); // an empty one, left out
    jsonl.push('\n');
    std::fs::write(root.join("more.jsonl"), &jsonl).unwrap();
    let gz = |path: PathBuf, text: &str| {
        let f = std::fs::File::create(path).unwrap();
        let mut e = flate2::write::GzEncoder::new(f, flate2::Compression::default());
        e.write_all(text.as_bytes()).unwrap();
        e.finish().unwrap();
    };
    let mut zipped = String::new();
    for i in 90..110 {
        zipped.push_str(&serde_json::json!({"text": doc(i)}).to_string());
        zipped.push('\n');
    }
    gz(root.join("deep/zipped.jsonl.gz"), &zipped);
    gz(root.join("deep/er/one.txt.gz"), &doc(110));
    std::fs::write(root.join("README.md"), "not an input").unwrap();
    std::fs::write(root.join(".hidden.txt"), "hidden, not an input").unwrap();
    root
}

fn go() -> impl FnMut(&weft_data::Progress) -> ControlFlow<()> {
    |_| ControlFlow::Continue(())
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn small_shards(threads: usize) -> PrepareOptions {
    PrepareOptions {
        shard_tokens: 900,
        threads,
        ..PrepareOptions::default()
    }
}

/// Every token of a prepared folder and its document ends, from the files.
fn all_tokens(dir: &Path) -> (Vec<u32>, Vec<u64>) {
    let index = Index::read(&dir.join("index.json")).unwrap();
    let (mut toks, mut ends) = (Vec::new(), Vec::new());
    for s in &index.shards {
        let base = toks.len() as u64;
        let b = std::fs::read(dir.join(&s.bin)).unwrap();
        toks.extend(
            b.chunks(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
        );
        let i = std::fs::read(dir.join(&s.idx)).unwrap();
        ends.extend(
            i.chunks(8)
                .map(|c| base + u64::from_le_bytes(c.try_into().unwrap())),
        );
    }
    (toks, ends)
}

#[test]
fn preparing_twice_gives_identical_bytes_whatever_the_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let root = corpus(tmp.path());
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let ra = prepare(std::slice::from_ref(&root), &a, &small_shards(1), &mut go()).unwrap();
    let rb = prepare(std::slice::from_ref(&root), &b, &small_shards(2), &mut go()).unwrap();
    assert_eq!(ra, rb);
    assert_eq!(files(&a), files(&b));
    // 60 + 30 + 20 + 1 documents; the empty one is left out.
    assert_eq!((ra.documents, ra.empty_documents), (111, 1));
    assert!(ra.shards > 3, "{ra:?}");
    let index = Index::read(&a.join("index.json")).unwrap();
    assert_eq!(index.settings.inputs.len(), 63);
    assert!(
        index
            .settings
            .inputs
            .iter()
            .all(|f| !f.path.contains(".hidden"))
    );
    // Inputs in path order: the root's files, then deep/'s, then deep/er/'s.
    let order: Vec<&str> = index
        .settings
        .inputs
        .iter()
        .map(|f| f.path.as_str())
        .collect();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted);
    // Every document ends with end-of-text and no shard exceeds its bound
    // (every document here is shorter than a shard).
    let (toks, ends) = all_tokens(&a);
    assert_eq!(ends.len(), 111);
    assert!(ends.iter().all(|&e| toks[e as usize - 1] == END_OF_TEXT));
    assert_eq!(toks.iter().filter(|&&t| t == END_OF_TEXT).count(), 111);
    assert!(index.shards.iter().all(|s| s.tokens <= 900));
    // The first document is the first file in path order, tokenized with
    // GPT-2's BPE (tiktoken's r50k_base).
    assert!(order[0].ends_with("deep/doc001.txt"), "{order:?}");
    let bpe = tiktoken_rs::r50k_base().unwrap();
    let first = std::fs::read_to_string(order[0]).unwrap();
    let want: Vec<u32> = bpe.encode_ordinary(&first);
    assert_eq!(&toks[..want.len()], &want[..]);
    // Already prepared: nothing is written, the report says so.
    let again = prepare(&[root], &a, &small_shards(2), &mut go()).unwrap();
    assert!(again.already_prepared);
    assert_eq!(files(&a), files(&b));
}

#[test]
fn an_interrupted_preparation_resumes_to_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = corpus(tmp.path());
    let clean = tmp.path().join("clean");
    prepare(
        std::slice::from_ref(&root),
        &clean,
        &small_shards(2),
        &mut go(),
    )
    .unwrap();
    let out = tmp.path().join("out");
    // Small batches: stop after the first batch that finished a shard.
    let mut stop = |p: &weft_data::Progress| {
        if p.shards >= 2 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let e = prepare(
        std::slice::from_ref(&root),
        &out,
        &small_shards(2),
        &mut stop,
    )
    .unwrap_err();
    assert!(matches!(e, DataError::Interrupted(_)), "{e}");
    assert!(out.join("prepare.partial.json").exists() && !out.join("index.json").exists());
    // Opening an unfinished folder says so.
    let e = Corpus::open(&out, 0.1).unwrap_err().to_string();
    assert!(e.contains("unfinished"), "{e}");
    // A resume keeps the finished shards (verified) and ends byte-identical.
    let r = prepare(
        std::slice::from_ref(&root),
        &out,
        &small_shards(1),
        &mut go(),
    )
    .unwrap();
    assert!(r.resumed_shards >= 2, "{r:?}");
    assert_eq!(files(&out), files(&clean));
    // Other inputs into a finished folder: refused, nothing touched.
    let other = tmp.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("x.txt"), "other text").unwrap();
    let e = prepare(&[other], &out, &small_shards(1), &mut go())
        .unwrap_err()
        .to_string();
    assert!(e.contains("other inputs") && e.contains("x.txt"), "{e}");
    assert_eq!(files(&out), files(&clean));
    // A folder that holds something else: refused.
    let busy = tmp.path().join("busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("precious"), "keep").unwrap();
    let e = prepare(&[root], &busy, &small_shards(1), &mut go())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not empty"), "{e}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let t = |name: &str, text: &[u8]| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let cases: Vec<(PathBuf, &str)> = vec![
        (
            t("bad.jsonl", b"{\"text\": \"ok\"}\n{not json}\n"),
            "bad.jsonl:2: not JSON",
        ),
        (
            t("nofield.jsonl", b"{\"body\": \"x\"}\n"),
            "nofield.jsonl:1: no field \"text\"",
        ),
        (t("num.jsonl", b"{\"text\": 3}\n"), "is not a string"),
        (
            t("latin1.txt", b"caf\xe9"),
            "latin1.txt: not UTF-8 text (invalid byte at offset 3)",
        ),
        (t("notes.md", b"x"), "notes.md: not a text input"),
        (tmp.path().join("missing.txt"), "missing.txt"),
    ];
    for (input, want) in cases {
        let e = prepare(&[input], &out, &PrepareOptions::default(), &mut go())
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e:?} should contain {want:?}");
    }
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = prepare(
        std::slice::from_ref(&empty),
        &out,
        &PrepareOptions::default(),
        &mut go(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("no .txt or .jsonl"), "{e}");
    std::fs::write(empty.join("a.txt"), "").unwrap();
    let e = prepare(
        &[empty],
        &tmp.path().join("out2"),
        &PrepareOptions::default(),
        &mut go(),
    )
    .unwrap_err();
    assert!(matches!(e, DataError::Empty), "{e}");
}

/// Folder walks visit each real folder and file once (a link loop adds
/// nothing) and read names that are not UTF-8; an input edited in place
/// is never called prepared; an index naming a file outside its folder is
/// refused; `--threads` is bounded by the machine's cores.
#[cfg(unix)]
#[test]
fn walks_stale_inputs_and_paths_outside_the_folder() {
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("in");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("a.txt"), "alpha beta gamma").unwrap();
    std::fs::write(root.join("sub/b.txt"), "delta epsilon").unwrap();
    let odd = std::ffi::OsStr::from_bytes(b"caf\xe9.txt");
    std::fs::write(root.join(odd), "zeta eta theta").unwrap();
    std::os::unix::fs::symlink(".", root.join("loop")).unwrap();
    std::os::unix::fs::symlink("sub", root.join("again")).unwrap();
    std::os::unix::fs::symlink("a.txt", root.join("twice.txt")).unwrap();
    let out = tmp.path().join("p");
    let r = prepare(
        std::slice::from_ref(&root),
        &out,
        &small_shards(1),
        &mut go(),
    )
    .unwrap();
    assert_eq!(
        r.documents, 3,
        "a.txt, sub/b.txt and the non-UTF-8 name, once each"
    );

    // edited in place, same size: not "already prepared"
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(root.join("a.txt"), "ALPHA beta gamma").unwrap();
    let e = prepare(
        std::slice::from_ref(&root),
        &out,
        &small_shards(1),
        &mut go(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("holds a preparation of other inputs") && e.contains("a.txt"),
        "{e}"
    );

    // an index naming a shard outside the folder
    let index = out.join("index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(
        &index,
        text.replace("\"shard-00000.bin\"", "\"../outside.bin\""),
    )
    .unwrap();
    let e = Corpus::open(&out, 0.1).unwrap_err().to_string();
    assert!(
        e.contains("index.json") && e.contains("\"../outside.bin\" is not a plain file name"),
        "{e}"
    );

    // thread fan-out
    let many = PrepareOptions {
        threads: 100_000,
        ..PrepareOptions::default()
    };
    let e = prepare(&[root], &tmp.path().join("q"), &many, &mut go())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--threads: 100000 tokenizer threads, more than 4 per core"),
        "{e}"
    );
    assert!(!tmp.path().join("q").exists());
}

#[test]
fn damaged_shards_are_never_trained_on() {
    let tmp = tempfile::tempdir().unwrap();
    let root = corpus(tmp.path());
    let out = tmp.path().join("p");
    prepare(&[root], &out, &small_shards(2), &mut go()).unwrap();
    let index = Index::read(&out.join("index.json")).unwrap();
    let shard = out.join(&index.shards[0].bin);
    let good = std::fs::read(&shard).unwrap();

    // One flipped byte: opening is cheap (lengths only), but the first
    // read of the damaged block fails, naming the file, and so does verify.
    let mut bad = good.clone();
    bad[10] ^= 1;
    std::fs::write(&shard, &bad).unwrap();
    let c = Corpus::open(&out, 0.1).unwrap();
    let e = c.verify().unwrap_err().to_string();
    assert!(
        e.contains("shard-00000.bin") && e.contains("checksum mismatch"),
        "{e}"
    );
    let l = Loader::new(vec![(c, 1.0)], 8, 0).unwrap();
    let errors = (0..200)
        .filter_map(|g| l.train_sequence(g, &mut Vec::new()).err())
        .collect::<Vec<_>>();
    assert!(!errors.is_empty());
    assert!(
        errors
            .iter()
            .all(|e| e.to_string().contains("shard-00000.bin"))
    );

    // Truncated: an error when opening, naming the file.
    std::fs::write(&shard, &good[..good.len() - 2]).unwrap();
    let e = Corpus::open(&out, 0.1).unwrap_err().to_string();
    assert!(
        e.contains("shard-00000.bin") && e.contains("truncated"),
        "{e}"
    );
    std::fs::write(&shard, &good).unwrap();
    Corpus::open(&out, 0.1).unwrap().verify().unwrap();

    // A damaged index is an error naming it.
    std::fs::write(out.join("index.json"), "{\"format\": 1}").unwrap();
    let e = Corpus::open(&out, 0.1).unwrap_err().to_string();
    assert!(e.contains("index.json"), "{e}");
    let e = Corpus::open(tmp.path(), 0.1).unwrap_err().to_string();
    assert!(e.contains("not token data"), "{e}");
}

#[test]
fn the_order_is_a_pure_function_of_the_sample_number() {
    let tmp = tempfile::tempdir().unwrap();
    let root = corpus(tmp.path());
    let out = tmp.path().join("p");
    prepare(&[root], &out, &small_shards(2), &mut go()).unwrap();
    let (toks, ends) = all_tokens(&out);
    let open = || Loader::new(vec![(Corpus::open(&out, 0.1).unwrap(), 1.0)], 16, 7).unwrap();
    let (a, b) = (open(), open());
    let part = &a.parts()[0];
    let n = part.train_windows();
    // The split is at a document boundary, and about 10% of the tokens.
    let train = part.corpus.train.len();
    assert!(ends.contains(&train), "{train}");
    let val = part.corpus.val.len() as f64 / toks.len() as f64;
    assert!((0.05..0.2).contains(&val), "{val}");
    // Each epoch visits every window once; epochs are shuffled differently.
    let epoch = |e: u64| -> Vec<u64> { (e * n..(e + 1) * n).map(|g| a.locate(g).1).collect() };
    let (e0, e1) = (epoch(0), epoch(1));
    let mut s = e0.clone();
    s.sort();
    assert_eq!(s, (0..n).collect::<Vec<_>>());
    assert_ne!(e0, e1);
    // Sample g: the same tokens from two loaders, in any order of asking,
    // and exactly the corpus' window.
    for g in [5u64, 0, 3 * n + 1, 17, 10_000] {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        a.train_sequence(g, &mut x).unwrap();
        b.train_sequence(g, &mut y).unwrap();
        assert_eq!(x, y);
        let w = a.locate(g).1 as usize;
        assert_eq!(x, toks[w * 16..w * 16 + 17]);
    }
    // Validation: the held-out tokens in order.
    let v = a.val_sequences(3).unwrap();
    let start = train as usize;
    assert_eq!(v[1], toks[start + 16..start + 33]);
}

#[test]
fn blends_give_their_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let root = corpus(tmp.path());
    let (x, y) = (tmp.path().join("x"), tmp.path().join("y"));
    prepare(
        &[root.join("deep")],
        &x,
        &PrepareOptions::default(),
        &mut go(),
    )
    .unwrap();
    prepare(
        &[root.join("more.jsonl")],
        &y,
        &PrepareOptions::default(),
        &mut go(),
    )
    .unwrap();
    let l = Loader::new(
        vec![
            (Corpus::open(&x, 0.2).unwrap(), 3.0),
            (Corpus::open(&y, 0.2).unwrap(), 1.0),
        ],
        8,
        1,
    )
    .unwrap();
    let shares = l.shares(1000);
    assert_eq!(shares.iter().map(|s| s.samples).sum::<u64>(), 1000);
    assert!((shares[0].fraction - 0.75).abs() < 0.002, "{shares:?}");
    let counted = (0..1000).filter(|&g| l.locate(g).0 == 0).count();
    assert_eq!(counted as u64, shares[0].samples);
    assert!(shares[1].epochs > 0.0);
    let e = Loader::new(vec![(Corpus::open(&x, 0.2).unwrap(), 0.0)], 8, 1).unwrap_err();
    assert!(e.to_string().contains("weight"), "{e}");
    let e = Loader::new(vec![(Corpus::open(&x, 0.2).unwrap(), 1.0)], 100_000, 1).unwrap_err();
    assert!(e.to_string().contains("block size"), "{e}");
}

#[test]
fn megatron_and_llmc_files_read_as_written() {
    let Some(py) = python("numpy") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let root = corpus(tmp.path());
    let out = tmp.path().join("p");
    prepare(&[root], &out, &PrepareOptions::default(), &mut go()).unwrap();
    let (toks, ends) = all_tokens(&out);
    // The documents without their end-of-text.
    let mut docs = Vec::new();
    let mut s = 0;
    for &e in &ends {
        docs.push(toks[s as usize..e as usize - 1].to_vec());
        s = e;
    }
    let json = tmp.path().join("docs.json");
    std::fs::write(&json, serde_json::json!({ "docs": docs }).to_string()).unwrap();
    let foreign = tmp.path().join("foreign");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/write_foreign.py");
    let o = Command::new(&py)
        .arg(script)
        .arg(&json)
        .arg(&foreign)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Every token of a corpus through windows of one token (each
    // split's last token is only ever a target).
    let whole = |c: &Corpus| -> Vec<u32> {
        let mut v = Vec::new();
        let loader = Loader::new(vec![(Corpus::open(&c.path, 0.1).unwrap(), 1.0)], 1, 0).unwrap();
        let p = &loader.parts()[0];
        for g in 0..p.train_windows() {
            let mut w = Vec::new();
            loader.train_sequence(g, &mut w).unwrap();
            v.push((loader.locate(g).1, w[0]));
        }
        v.sort();
        let mut out: Vec<u32> = v.into_iter().map(|(_, t)| t).collect();
        out.extend(
            loader
                .val_sequences(usize::MAX)
                .unwrap()
                .into_iter()
                .map(|w| w[0]),
        );
        out
    };

    // Megatron-LM: the same documents, each with its end-of-text, so the
    // same tokens as ours; named by prefix or by either file.
    for name in [
        "megatron_text_document",
        "megatron_text_document.idx",
        "megatron_text_document.bin",
    ] {
        let c = Corpus::open(&foreign.join(name), 0.1).unwrap();
        assert_eq!(c.format, Format::Megatron);
        assert_eq!(c.documents, Some(111));
        assert!(
            ends.contains(&c.train.len()),
            "split at a document boundary"
        );
        let got = whole(&c);
        // Windows of one token leave out the stream's last token.
        assert_eq!(got.len() as u64, c.train.len() + c.val.len() - 2);
    }
    let c = Corpus::open(&foreign.join("megatron_text_document"), 0.1).unwrap();
    let got = whole(&c);
    let t = c.train.len() as usize;
    assert_eq!(got[..t - 1], toks[..t - 1]);
    assert_eq!(got[t - 1..], toks[t..toks.len() - 1]);

    // llm.c: end-of-text before each document; one file split by
    // document, or its own val shard.
    let mut llmc = Vec::new();
    for d in &docs {
        llmc.push(END_OF_TEXT);
        llmc.extend(d);
    }
    let c = Corpus::open(&foreign.join("llmc_all.bin"), 0.1).unwrap();
    assert_eq!(c.format, Format::LlmC);
    assert_eq!(c.train.len() + c.val.len(), llmc.len() as u64);
    let got = whole(&c);
    let t = c.train.len() as usize;
    assert_eq!(got[..t - 1], llmc[..t - 1]);
    assert_eq!(got[t - 1..], llmc[t..llmc.len() - 1]);
    let c = Corpus::open(&foreign.join("llmc"), 0.1).unwrap();
    assert_eq!(c.val.len(), docs[0].len() as u64 + 1);

    // Truncated foreign files: errors naming the file.
    let bin = foreign.join("megatron_text_document.bin");
    let b = std::fs::read(&bin).unwrap();
    std::fs::write(&bin, &b[..b.len() - 2]).unwrap();
    let e = Corpus::open(&foreign.join("megatron_text_document"), 0.1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("megatron_text_document.bin") && e.contains("truncated"),
        "{e}"
    );
    let f = foreign.join("llmc_all.bin");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() - 1]).unwrap();
    let e = Corpus::open(&f, 0.1).unwrap_err().to_string();
    assert!(e.contains("llmc_all.bin"), "{e}");
}
