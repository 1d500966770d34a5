//! Parquet files of a Hugging Face dataset as training data, from the command line: pyarrow
//! wrote the files (`crates/model/tests/fixtures/parquet/make.py`).

mod common;

use std::path::Path;
use std::process::Output;

use common::{dir, lazarus, log as log_of};

fn fixture(name: &str) -> String {
    format!("{}/../model/tests/fixtures/parquet/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `lazarus train` of the tiny model on the Parquet `data`, its token caches under `cache`.
fn train_on(data: &str, cache: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--data", data, "--data-cache", cache.to_str().unwrap()];
    args.extend(&common::tiny_model("2")[..14]);
    args.extend(extra);
    lazarus(&args)
}

/// The token caches made under `cache`.
fn caches(cache: &Path) -> usize {
    std::fs::read_dir(cache).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".idx")).count()
}

/// `steps` steps of `train` uninterrupted, then half of them saved and the run resumed to
/// `steps` in `d`: each step once, with the uninterrupted run's losses. The two first runs'
/// stderr.
fn resumes_exactly(d: &Path, steps: u64, train: impl Fn(&[&str]) -> Output) -> (String, String) {
    let (whole, part, ck) = (d.join("whole.jsonl"), d.join("part.jsonl"), d.join("ck"));
    let (all, half) = (steps.to_string(), (steps / 2).to_string());
    let out = train(&["--steps", &all, "--no-save", "--json-log", whole.to_str().unwrap()]);
    let first = stderr(&out);
    assert!(out.status.success(), "{first}");
    let out = train(&["--steps", &half, "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    let second = stderr(&out);
    assert!(out.status.success(), "{second}");
    let out =
        lazarus(&["train", "--resume", "--steps", &all, "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (a, b) = (log_of(&whole).0, log_of(&part).0);
    assert_eq!(a.len() as u64, steps);
    assert_eq!(a.iter().map(|s| s.0).collect::<Vec<_>>(), b.iter().map(|s| s.0).collect::<Vec<_>>());
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed");
    }
    (first, second)
}

/// A text column (the format found from the extension) is read once into the token cache and
/// found there by the next run; a run stopped and resumed reads the windows the uninterrupted
/// run reads; worker processes open the cache too; `lazarus eval` reads Parquet; a column of
/// token ids trains as it is.
#[test]
fn parquet_text_and_token_ids_train_resume_exactly_and_are_cached_once() {
    let d = dir("parquet");
    let cache = d.join("cache");
    let data = fixture("train.parquet");
    let (first, second) = resumes_exactly(&d, 4, |extra| train_on(&data, &cache, extra));
    assert!(first.contains("1 Parquet file(s)") && first.contains("1200 rows of 3 row groups read into"), "{first}");
    assert!(second.contains("from the cache"), "{second}");
    let out = train_on(&data, &cache, &["--steps", "2", "--no-save", "--workers", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(caches(&cache), 1, "one cache for one file, column and tokenizer");
    let ck = d.join("ck");
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let out =
        lazarus(&["eval", "--checkpoint", ck.join(latest.trim()).to_str().unwrap(), "--data", &fixture("text.parquet"), "--windows", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Token ids: a list<int32> column named, ids below the vocabulary.
    let extra = ["--data-column", "input_ids", "--vocab-size", "1000", "--steps", "2", "--no-save"];
    let out = train_on(&fixture("train_ids.parquet"), &cache, &extra);
    let err = stderr(&out);
    assert!(out.status.success() && err.contains("400 rows"), "{err}");
}

#[test]
fn a_parquet_column_that_is_not_there_or_not_data_is_refused_by_name() {
    let d = dir("parquet-bad");
    let cache = d.join("cache");
    let data = fixture("train_ids.parquet");
    let run = |extra: &[&str]| {
        let mut args = vec!["--steps", "1", "--no-save"];
        args.extend(extra);
        let out = train_on(&data, &cache, &args);
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
    let (first, _) = resumes_exactly(&d, 6, |extra| {
        let mut args = vec!["--data-weights", "3,1"];
        args.extend(extra);
        train_on(&data, &cache, &args)
    });
    assert!(first.contains("2 Parquet file(s) blended by weight"), "{first}");
    assert_eq!(caches(&cache), 2, "a cache for each file of a blend");
}
