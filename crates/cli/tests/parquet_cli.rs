//! Parquet files of a Hugging Face dataset as training data, from the command line: pyarrow
//! wrote the files (`crates/model/tests/fixtures/parquet/make.py`).

mod common;

use common::{dir, lazarus, log as log_of};

fn fixture(name: &str) -> String {
    format!("{}/../model/tests/fixtures/parquet/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A text column (the format found from the extension) is read once into the token cache and
/// found there by the next run; a run stopped and resumed reads the windows the uninterrupted
/// run reads; worker processes open the cache too; `lazarus eval` reads Parquet; a column of
/// token ids trains as it is.
#[test]
fn parquet_text_and_token_ids_train_resume_exactly_and_are_cached_once() {
    let d = dir("parquet");
    let cache = d.join("cache");
    let cache_s = cache.to_str().unwrap().to_string();
    let data = fixture("train.parquet");
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--data", &data, "--data-cache", &cache_s];
        args.extend(&common::tiny_model("2")[..14]);
        args.extend(extra);
        lazarus(&args)
    };
    let (whole, part, ck) = (d.join("whole.jsonl"), d.join("part.jsonl"), d.join("ck"));
    let out = train(&["--steps", "4", "--no-save", "--json-log", whole.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("1 Parquet file(s)") && err.contains("1200 rows of 3 row groups read into"), "{err}");
    let out = train(&["--steps", "2", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(out.status.success() && err.contains("from the cache"), "{err}");
    let out =
        lazarus(&["train", "--resume", "--steps", "4", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (a, b) = (log_of(&whole).0, log_of(&part).0);
    assert_eq!(a.iter().map(|s| s.0).collect::<Vec<_>>(), b.iter().map(|s| s.0).collect::<Vec<_>>());
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed");
    }
    let out = train(&["--steps", "2", "--no-save", "--workers", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let caches =
        std::fs::read_dir(&cache).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".idx")).count();
    assert_eq!(caches, 1, "one cache for one file, column and tokenizer");
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let out =
        lazarus(&["eval", "--checkpoint", ck.join(latest.trim()).to_str().unwrap(), "--data", &fixture("text.parquet"), "--windows", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Token ids: a list<int32> column named, ids below the vocabulary.
    let ids = fixture("train_ids.parquet");
    let mut args = vec![
        "train",
        "--data",
        &ids,
        "--data-column",
        "input_ids",
        "--data-cache",
        &cache_s,
        "--vocab-size",
        "1000",
        "--steps",
        "2",
        "--no-save",
    ];
    args.extend(&common::tiny_model("2")[..14]);
    let out = lazarus(&args);
    let err = stderr(&out);
    assert!(out.status.success() && err.contains("400 rows"), "{err}");
}

#[test]
fn a_parquet_column_that_is_not_there_or_not_data_is_refused_by_name() {
    let d = dir("parquet-bad");
    let cache = d.join("cache");
    let run = |extra: &[&str]| {
        let mut args = vec!["train", "--data", "", "--data-cache", cache.to_str().unwrap(), "--steps", "1", "--no-save"];
        let data = fixture("train_ids.parquet");
        args[2] = &data;
        args.extend(&common::tiny_model("2")[..14]);
        args.extend(extra);
        let out = lazarus(&args);
        (out.status.success(), stderr(&out))
    };
    let (ok, err) = run(&["--data-column", "labels", "--vocab-size", "1000"]);
    assert!(!ok && err.contains("no column `labels` (it has input_ids, attention_mask)"), "{err}");
    let (ok, err) = run(&["--data-column", "input_ids", "--vocab-size", "500"]);
    assert!(!ok && err.contains("outside the vocabulary of 500"), "{err}");
    let (ok, err) = run(&["--data-column", "input_ids", "--vocab-size", "1000", "--data-format", "text"]);
    assert!(!ok && err.contains("--data-column names a column of Parquet files"), "{err}");
}

/// `--data-weights` blends Parquet files as it blends Megatron datasets (a token cache each): a
/// run stopped and resumed draws the windows the uninterrupted run draws.
#[test]
fn blended_parquet_files_resume_exactly() {
    let d = dir("parquet-blend");
    let cache = d.join("cache");
    let data = format!("{},{}", fixture("train.parquet"), fixture("text.parquet"));
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--data", &data, "--data-weights", "3,1", "--data-cache", cache.to_str().unwrap()];
        args.extend(&common::tiny_model("2")[..14]);
        args.extend(extra);
        lazarus(&args)
    };
    let (whole, part, ck) = (d.join("whole.jsonl"), d.join("part.jsonl"), d.join("ck"));
    let out = train(&["--steps", "6", "--no-save", "--json-log", whole.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(out.status.success() && err.contains("2 Parquet file(s) blended by weight"), "{err}");
    let caches =
        std::fs::read_dir(&cache).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".idx")).count();
    assert_eq!(caches, 2, "a cache for each file of a blend");
    let out = train(&["--steps", "3", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out =
        lazarus(&["train", "--resume", "--steps", "6", "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (a, b) = (log_of(&whole).0, log_of(&part).0);
    assert_eq!(a.len(), 6);
    assert_eq!(a.iter().map(|s| s.0).collect::<Vec<_>>(), b.iter().map(|s| s.0).collect::<Vec<_>>());
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed");
    }
}
